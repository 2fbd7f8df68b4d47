"""Checkpointed segments (Stage.checkpoint, planner.checkpoint): a net that runs its training
forward in segments gives the same weights and running statistics bit for bit, keeps only
the maps that cross a segment's start (what planner.checkpoint.kept_bytes says), and every
plan that checkpoints equals local training."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from planner.checkpoint import kept_bytes, segment_starts, stage_segments
from planner.plan import Plan, Stage
from swarm.zoo import build_model, net as net_module
from tests.test_execution import _cfg, _local, _planned, _worst
from tests.test_recompute import _passes

CFG = Path(__file__).resolve().parent / "cfg" / "darknet"


@pytest.mark.parametrize("name,size,dtype", [("yolov2-16", 64, torch.float64), ("yolov4-tiny", 64, torch.float32),
                                             ("mobilenetv2", 64, torch.float32), ("resnet18", 64, torch.float32),
                                             ("efficientnet-b0", 64, torch.float32)])  # efficientnet: dropout, swish, squeeze-and-excitation
def test_checkpointing_gives_the_same_weights_and_statistics_bit_for_bit(name, size, dtype):
    net, desc, _ = build_model(name, size, seed=3)
    net = net.to(dtype).train()
    other = copy.deepcopy(net)
    other.checkpoint = True
    assert len(segment_starts(desc)) > 1
    x = torch.rand(3, 3, size, size, dtype=dtype)
    plain, checkpointed = _passes(net, desc, x), _passes(other, desc, x)
    for key, value in plain.items():  # weights, momentum aside, and BatchNorm's running statistics
        assert torch.equal(value, checkpointed[key]), key


def _kept(net, x, first: int, last: int, live: dict) -> int:
    """Bytes of the maps a checkpointing forward of layers [first, last) holds for its backward:
    what each segment is given to run again (each storage once, the parameters aside)."""
    held: dict[int, int] = {}
    run = net_module.checkpoint

    def counting(fn, *args, **kw):
        for t in args:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return run(fn, *args, **kw)

    net_module.checkpoint = counting
    try:
        net.forward_range(first, last, live, list(range(len(x))))
    finally:
        net_module.checkpoint = run
    return sum(held.values())


@pytest.mark.parametrize("name", ["yolov2-16", "yolov4-tiny", "resnet18"])
def test_a_checkpointing_net_keeps_what_the_planner_counts(name):
    net, desc, _ = build_model(name, 64, seed=1)
    net.train()
    net.checkpoint = True
    x = torch.rand(2, 3, 64, 64)
    assert _kept(net, x, 0, len(desc.layers), {-1: x}) == 2 * kept_bytes(desc, 0, len(desc.layers))
    # a stage that starts inside a segment keeps its inputs for its first
    n = len(desc.layers)
    first = next(i for i in range(1, n) if i not in segment_starts(desc))
    with torch.no_grad():
        live = {k: v.detach() for k, v in net.eval().forward_range(0, first, {-1: x}).items()}
    net.train()
    assert stage_segments(desc, first, n)[0][0] == first
    assert _kept(net, x, first, n, live) == 2 * kept_bytes(desc, first, n)


def _stages(kind: str, n: int, cuts: list[int]) -> list[Stage]:
    bounds = [0, *cuts, n]
    if kind == "pp4":
        return [Stage(a, b, "single", [f"d{i}"], checkpoint=True) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    if kind == "replicas":  # whole micro-batches on each of three devices, uneven shares
        return [Stage(0, n, "single", ["d0", "d1", "d2"], replicas=3, shares=[2, 1, 1], checkpoint=True)]
    if kind == "dp-replicas":
        return [Stage(0, n, "dp", ["d0", "d1"], allocation={"d0": 2, "d1": 2}, replicas=2, groups=[1, 1],
                      checkpoint=True)]
    if kind == "hybrid":  # a tiles front that keeps its maps, a checkpointing stage behind it
        return [Stage(0, cuts[0], "tiles", ["d0", "d1"], grid=(1, 2), tile_devices=["d0", "d1"]),
                Stage(cuts[0], n, "single", ["d2"], checkpoint=True)]
    raise AssertionError(kind)


@pytest.mark.parametrize("name,n,cuts", [("yolov4-tiny", 38, [5, 13, 33]), ("resnet18", 28, [3, 9, 21])])
@pytest.mark.parametrize("kind", ["pp4", "replicas", "dp-replicas", "hybrid"])
def test_plans_that_checkpoint_equal_local_training(name, n, cuts, kind, monkeypatch):
    if kind == "hybrid":  # tiles take the plain layers in front of the first block
        cuts = [2 if name == "yolov4-tiny" else 1, *cuts[1:]]
    cfg = _cfg(str(CFG / f"{name}.cfg"), 4, img_size=64)
    segments, run = [], net_module.checkpoint
    monkeypatch.setattr(net_module, "checkpoint", lambda fn, *a, **kw: segments.append(fn) or run(fn, *a, **kw))
    trainer = _planned(cfg, Plan(cfg.model, 64, 8, 4, _stages(kind, n, cuts)))
    assert segments  # the stages did run in segments
    worst, key = _worst(trainer.net.state_dict(), _local(cfg))
    assert worst < 1e-9, (key, worst)


@pytest.mark.parametrize("kind", ["pp4", "replicas"])
def test_steps_over_the_step_befores_sums_that_checkpoint_equal_local_training(kind):
    """Between backups each step starts while the step before's sums travel, each layer's
    forward waiting for its own weights' update: the backward's second forward of a segment
    comes after those updates, and the weights are still local training's."""
    cfg = _cfg(str(CFG / "yolov4-tiny.cfg"), 4, img_size=64)
    trainer = _planned(cfg, Plan(cfg.model, 64, 8, 4, _stages(kind, 38, [5, 13, 33])), steps=3, backup_interval=1000)
    worst, key = _worst(trainer.net.state_dict(), _local(cfg, 3))
    assert worst < 1e-9, (key, worst)
