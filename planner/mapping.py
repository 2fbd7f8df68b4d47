"""Plans whose devices map a micro-batch's largest blocks afresh (Plan.mapped).

On glibc as `swarm` starts it (swarm.host.malloc) a device can serve every block of
MAPPED_FROM bytes or more from a mapping of its own, unmapped when freed, instead of from its
heap. The heap keeps freed blocks for reuse, but the backward's
buffers, of other sizes than the maps freed before them, mostly do not fit in those holes, and
the heap grows: a 4-sample share of yolov2-16 at 416 held 877 MiB above its start in the heap
and 525 mapped (jemalloc: 611). Mapped blocks come back zeroed by the kernel each time, which
costs CPU time (bench/RESULTS.md): in a 0.2-core, 1 GiB cgroup, 4 passes of 4 samples took
6.7-7.1 CPU-s mapped, 5.4 in the heap (which held 818 MiB, and was killed once), and 5.8-6.6 on
glibc's defaults, which map blocks of 32 MiB or more and peaked at 722-785 MiB.

So mapping is a trade, as remaking BatchNorm and checkpointing are: less memory for more
compute. `auto` weighs it where every device of the cluster can map: the memory model of a
mapped heap (MAPPED_SLACK, and the backward's buffers in the room freed maps leave), and each
device's compute plus the time to fault its mapped blocks in again, at the rate its profile
measured (Device.map_s_per_byte). A plan maps on all its devices or on none.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.cluster import Cluster
from planner.costs import CostTable
from planner.memory import MemoryModel
from planner.model_desc import ModelDesc

# blocks of this many bytes or more are mapped afresh (swarm.host.malloc.MAPPED_FROM)
MAPPED_FROM = 4 << 20
# resident bytes per byte of activations and gradients on a mapped heap, the papers' model:
# yolov2-16 at 416 in one process above its start, 1, 2 and 4 samples 148-156, 275-281 and
# 520-526 MiB against this model's 193, 321 and 578 with the stage scratch
MAPPED_SLACK = 1.0


def can_map(cluster: Cluster) -> bool:
    """Whether every device of the cluster can map its largest blocks (its profile measured
    what that costs, on glibc as swarm starts it)."""
    return all(d.map_s_per_byte > 0 for d in cluster.devices)


def mapped_model(mem: MemoryModel) -> MemoryModel:
    """`mem` for devices that map their largest blocks: the slack of a mapped heap, and the
    backward's buffers in the room that freed maps leave."""
    return replace(mem, slack=MAPPED_SLACK, growth=0.0, reuse=True)


def fresh_bytes(desc: ModelDesc, batch_sizes) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward): (layers, len(batch_sizes)) bytes of the blocks of MAPPED_FROM or
    more that a micro-batch of each size allocates in each layer's forward (its output and
    each pointwise step's) and backward (the gradients of its output, of each pointwise step
    and of its input), and a max-pool's positions in torch's int64 both ways. yolov2-16 at 416,
    4 samples: 1909 MiB a pass, where torch's profiler saw 1823 MiB of such blocks and the
    kernel 2197 MiB mapped and unmapped (with the convolution library's own)."""
    mem = MemoryModel.estimated(desc)
    sizes = np.asarray(batch_sizes, dtype=float)
    fwd = np.zeros((len(desc.layers), len(sizes)))
    bwd = np.zeros_like(fwd)
    for i, layer in enumerate(desc.layers):
        out = mem.out_bytes[i]
        pointwise = (int(layer.batch_normalize) + int(layer.activation != "linear")
                     if layer.kind in ("conv", "connected") else 0)
        maps_out = [out] * (1 + pointwise)
        extra_fwd, extra_bwd = [], []
        if layer.kind == "maxpool":  # as swarm.zoo.layers runs it: torch's kernel in channels-last
            extra_fwd = [out, 2 * out]  # the map made contiguous; torch's int64 positions
            extra_bwd = [2 * out, 2 * out]  # the kept codes made int64 positions again, and offset
        for j, b in enumerate(sizes):
            fwd[i, j] = sum(m * b for m in maps_out if m * b >= MAPPED_FROM)
            bwd[i, j] = fwd[i, j] + (mem.in_bytes[i] * b if mem.in_bytes[i] * b >= MAPPED_FROM else 0.0)
            bwd[i, j] += sum(m * b for m in extra_bwd if m * b >= MAPPED_FROM)
            fwd[i, j] += sum(m * b for m in extra_fwd if m * b >= MAPPED_FROM)
    return fwd, bwd


def _mapped_costs(costs: CostTable, fresh: tuple[np.ndarray, np.ndarray], s_per_byte: float) -> CostTable:
    fwd, bwd = fresh
    return replace(costs, fwd=costs.fwd + fwd * s_per_byte, bwd=costs.bwd + bwd * s_per_byte,
                   source=costs.source + " + mapped blocks")


def mapping(mem: MemoryModel, cluster: Cluster, desc: ModelDesc) -> tuple[MemoryModel, Cluster]:
    """The memory model (mapped_model) and devices of a plan whose devices map their largest
    blocks afresh (idempotent): each layer's forward and backward take longer by the time
    the device faults in its blocks of MAPPED_FROM or more."""
    if not can_map(cluster):
        cannot = [d.name for d in cluster.devices if d.map_s_per_byte <= 0]
        raise ValueError(f"{', '.join(cannot)} cannot map blocks afresh (glibc as swarm starts it, "
                         f"measured by a profile)")
    if cluster.mapping:
        return mapped_model(mem), cluster
    devices = []
    for d in cluster.devices:
        costs = _mapped_costs(d.costs, fresh_bytes(desc, d.costs.batch_sizes), d.map_s_per_byte)
        cpu = (_mapped_costs(d.cpu_costs, fresh_bytes(desc, d.cpu_costs.batch_sizes), d.map_s_per_byte)
               if d.cpu_costs is not None else None)
        devices.append(replace(d, costs=costs, cpu_costs=cpu))
    return mapped_model(mem), replace(cluster, devices=devices, mapping=True)
