"""Whether a network's BatchNorm layers can train on micro-batches of a given size.

torch's BatchNorm, training, needs more than one value per channel to normalise. A layer
whose map is 1x1 (a small --img-size, or the output of a [connected] layer, which is (N, 1, 1))
has one value per channel for each sample, so a micro-batch of one sample cannot train
there. The rule, on the model's description alone:

    layers with BatchNorm over a 1x1 map   fewest samples a training pass takes
    none                                   1
    some                                   2

`swarm train` refuses a run whose micro-batches would be smaller (`microbatch_refusal`),
and the profiler measures such a network at 2 samples or more (`fewest_samples`).
"""
from __future__ import annotations

from planner.model_desc import LayerDesc, ModelDesc


def single_value_batchnorms(desc: ModelDesc) -> list[LayerDesc]:
    """The layers whose BatchNorm sees one value per channel for each sample (a 1x1 map)."""
    return [d for d in desc.layers if d.batch_normalize and d.out_shape[1] * d.out_shape[2] == 1]


def fewest_samples(desc: ModelDesc) -> int:
    """The fewest samples a training pass over the whole model can take: 2 where a BatchNorm
    sees a 1x1 map, else 1."""
    return 2 if single_value_batchnorms(desc) else 1


def microbatch_refusal(desc: ModelDesc, batch_size: int, microbatches: int) -> str | None:
    """Why `desc` cannot train on `batch_size` samples a step split into `microbatches`
    micro-batches (sizes differing by at most one, as swarm.data.microbatch_bounds splits
    them): one line naming the layer, its map and what to do; None when it can. Every
    micro-batch reaches every BatchNorm whole, on one device or across a dp group's shared
    statistics, so the smallest micro-batch decides. Splits that are not possible at all
    (more micro-batches than samples) are left to the check that says so."""
    layers = single_value_batchnorms(desc)
    if not layers or not 1 <= microbatches <= batch_size or batch_size // microbatches >= 2:
        return None
    first, others = layers[0], [d.index for d in layers[1:]]
    c, h, w = first.out_shape
    if first.kind == "connected":
        sees = f"layer {first.index}'s BatchNorm follows a [connected] layer ({c} values, one per output)"
    else:
        sees = f"layer {first.index}'s BatchNorm sees a {h}x{w} map"
    if others:
        sees += f" (as do those of layer{'s' if len(others) > 1 else ''} {_listed(others)})"
    ones = microbatches - batch_size % microbatches  # micro-batches of one sample
    made = ("micro-batches" if ones == microbatches else "a micro-batch" if ones == 1 else f"{ones} micro-batches")
    split = f"--batch-size {batch_size} in {microbatches} micro-batch{'es' if microbatches > 1 else ''}"
    larger = "" if any(d.kind == "connected" for d in layers) else " or a larger --img-size"
    return (f"{desc.name} at {desc.img_size}: {sees}, so a micro-batch of one sample gives it one value per channel, "
            f"and {split} makes {made} of one sample; use micro-batches of at least 2 samples "
            f"(--batch-size at least 2 x --microbatches){larger}")


def _listed(indices: list[int], most: int = 4) -> str:
    """12 and 13; 12, 13 and 14; 12, 13, 14, 15 and 3 more."""
    if len(indices) > most:
        return f"{', '.join(map(str, indices[:most]))} and {len(indices) - most} more"
    if len(indices) == 1:
        return str(indices[0])
    return f"{', '.join(map(str, indices[:-1]))} and {indices[-1]}"
