"""BatchNorm and its activation remade in the backward (swarm.zoo.recompute): the same gradients
bit for bit, less kept (what the planner's memory model says), every plan that remakes equal to
local training, and `auto` remaking where memory held its plan back and not where it did not."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from planner.inputs import PlanInputs
from planner.memory import MemoryModel, estimate_activation_bytes, recomputable
from planner.plan import Plan, PlanError, Stage
from planner.planners import _plan_auto, plan_auto
from planner.simulator import simulate
from planner.synthetic import flops_cluster
from swarm.execution import group_bn
from swarm.zoo import build_model, describe_model, recompute
from tests.test_execution import _cfg, _local, _planned, _worst

CFG = Path(__file__).resolve().parent / "cfg" / "darknet"


def _passes(net, desc, x, steps: int = 2):
    """Two SGD steps on a loss of every output; the weights and buffers after them."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        out = net.forward_range(0, len(desc.layers), {-1: x}, list(range(len(x))))
        sum((v.float() ** 2).mean() for v in out.values()).backward()
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("name,size,dtype", [("yolov2-16", 64, torch.float64), ("yolov4-tiny", 64, torch.float32),
                                             ("mobilenetv2", 64, torch.float32), ("resnet18", 64, torch.float32),
                                             ("efficientnet-b0", 64, torch.float32)])
def test_remaking_gives_the_same_weights_bit_for_bit(name, size, dtype):
    net, desc, _ = build_model(name, size, seed=3)
    net = net.to(dtype).train()
    other = copy.deepcopy(net)
    other.recompute = recomputable(desc)
    assert other.recompute and sum(getattr(m, "remade", False) for m in other.layers) == len(other.recompute)
    x = torch.rand(3, 3, size, size, dtype=dtype)
    kept, remade = _passes(net, desc, x), _passes(other, desc, x)
    assert kept.keys() == remade.keys()
    for k in kept:
        assert torch.equal(kept[k], remade[k]), k


def _streaming(monkeypatch, stream) -> list[int]:
    """Every remade layer back-propagates a few channels at a time (at the suite's small sizes no
    map reaches STREAM_FROM); the runs of channels that `stream`'s backwards took, listed."""
    monkeypatch.setattr(recompute, "STREAM_FROM", 0)
    monkeypatch.setattr(recompute, "CHUNK_BYTES", 3000)
    runs: list[int] = []
    remake = stream.remake

    def counted(self, c, weight, bias, j, k):
        runs.append(k - j)
        return remake(self, c, weight, bias, j, k)

    monkeypatch.setattr(stream, "remake", counted)
    return runs


@pytest.fixture
def streaming(monkeypatch):
    return _streaming(monkeypatch, recompute._PlainStream)


@pytest.mark.parametrize("name,size,dtype", [("yolov2-16", 64, torch.float64), ("yolov4-tiny", 64, torch.float32),
                                             ("mobilenetv2", 64, torch.float32), ("resnet18", 64, torch.float32),
                                             ("efficientnet-b0", 64, torch.float32)])
def test_streaming_gives_the_same_weights_bit_for_bit(name, size, dtype, streaming):
    """Remade layers that back-propagate a few channels at a time (leaky, ReLU6, ReLU and linear
    after BatchNorm; swish's layers remake whole maps), against keeping every map: the same
    weights and running statistics after two steps, bit for bit."""
    net, desc, _ = build_model(name, size, seed=3)
    net = net.to(dtype).train()
    other = copy.deepcopy(net)
    other.recompute = recomputable(desc)
    x = torch.rand(3, 3, size, size, dtype=dtype)
    kept, remade = _passes(net, desc, x), _passes(other, desc, x)
    assert len(streaming) > 2 * len(other.recompute) and min(streaming) < max(streaming)  # several runs a layer
    for k in kept:
        assert torch.equal(kept[k], remade[k]), k


def test_a_dp_group_that_streams_trains_as_one_that_does_not_bit_for_bit(monkeypatch):
    """A dp group's BatchNorm back-propagated a few channels at a time (the group's sums
    exchanged once a layer, as before) gives the weights the same group gives remaking whole
    maps, bit for bit, and both equal local training."""
    cfg = _cfg(str(CFG / "yolov4-tiny.cfg"), 2, img_size=64)
    plan = Plan(cfg.model, 64, 8, 2, _stages("dp", 38, [5, 13, 33]))
    whole = _planned(cfg, plan).net.state_dict()
    runs = _streaming(monkeypatch, group_bn._GroupStream)
    streamed = _planned(cfg, plan).net.state_dict()
    assert len(runs) > 2 * len(recomputable(describe_model(cfg.model, 64))) and min(runs) < max(runs)
    for k in whole:
        assert torch.equal(whole[k], streamed[k]), k
    worst, key = _worst(streamed, _local(cfg))
    assert worst < 1e-9, (key, worst)


def _kept_bytes(net, x) -> int:
    """Bytes of the tensors the forward keeps for the backward (parameters aside, each storage
    once): counted as swarm.zoo.recompute packs them, recipes not counted."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}
    pack = recompute.Recipes._pack

    def counting(self, t):
        packed = pack(self, t)
        if packed is t and t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return packed

    recompute.Recipes._pack = counting
    try:
        with recompute.Recipes():  # a net that remakes enters its own, inside this one
            net.forward_range(0, len(net.layers), {-1: x}, list(range(len(x))))
    finally:
        recompute.Recipes._pack = pack
    return sum(seen.values())


@pytest.mark.parametrize("name", ["yolov2-16", "yolov4-tiny", "resnet18"])
def test_a_net_that_remakes_keeps_what_the_memory_model_says(name):
    net, desc, _ = build_model(name, 64, seed=1)
    net.train()
    x = torch.rand(2, 3, 64, 64)
    whole = _kept_bytes(net, x)
    net.recompute = recomputable(desc)
    less = _kept_bytes(net, x)
    assert less < 0.72 * whole, (less, whole)
    for got, remade in ((whole, frozenset()), (less, recomputable(desc))):
        model = 2 * sum(estimate_activation_bytes(desc, remade))
        assert abs(got - model) <= 0.03 * model, (got, model)
    mem = MemoryModel.estimated(desc)
    assert mem.recomputing().activations(0, len(desc.layers), 2) == pytest.approx(
        2 * sum(estimate_activation_bytes(desc, recomputable(desc))))


def _stages(kind: str, n: int, cuts: list[int]) -> list[Stage]:
    bounds = [0, *cuts, n]
    if kind == "pp4":
        return [Stage(a, b, "single", [f"d{i}"], recompute=True) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    if kind == "dp":
        return [Stage(0, n, "dp", ["d0", "d1", "d2"], allocation={"d0": 2, "d1": 1, "d2": 1}, recompute=True)]
    if kind == "hybrid":  # a tiles front that keeps its maps, remaking stages behind it
        return [Stage(0, cuts[0], "tiles", ["d0", "d1"], grid=(1, 2), tile_devices=["d0", "d1"]),
                Stage(cuts[0], cuts[1], "dp", ["d1", "d2"], allocation={"d1": 3, "d2": 1}, recompute=True),
                Stage(cuts[1], n, "single", ["d3"], recompute=True)]
    raise AssertionError(kind)


@pytest.mark.parametrize("name,n,cuts", [("yolov4-tiny", 38, [5, 13, 33]), ("resnet18", 28, [3, 9, 21])])
@pytest.mark.parametrize("kind", ["pp4", "dp", "hybrid"])
def test_plans_that_remake_equal_local_training(name, n, cuts, kind):
    if kind == "hybrid":  # tiles take the plain layers in front of the first block
        cuts = [2 if name == "yolov4-tiny" else 1, *cuts[1:]]
    cfg = _cfg(str(CFG / f"{name}.cfg"), 2, img_size=64)
    trainer = _planned(cfg, Plan(cfg.model, 64, 8, 2, _stages(kind, n, cuts)))
    worst, key = _worst(trainer.net.state_dict(), _local(cfg))
    assert worst < 1e-9, (key, worst)


def test_a_plan_names_its_remaking_and_a_tiles_stage_may_not():
    plan = Plan("yolov2-16", 64, 8, 2, [Stage(0, 16, "dp", ["d0", "d1"], allocation={"d0": 2, "d1": 2}, recompute=True)])
    again = Plan.from_json(plan.to_json())
    assert again.stages[0].recompute is True and again.recomputes()
    tiles = Plan("yolov2-16", 64, 8, 2, [Stage(0, 16, "tiles", ["d0", "d1"], grid=(1, 2), tile_devices=["d0", "d1"],
                                               recompute=True)])
    with pytest.raises(PlanError, match="tiles stage keeps its own maps"):
        tiles.validate()


def test_auto_remakes_where_memory_held_its_plan_back_and_not_where_it_did_not():
    """Four equal devices, yolov2-16 at 416, batch 32 in 8: with 650 MiB a device cannot take a
    whole micro-batch keeping every map, so the best plan splits each among all four (a dp
    group, BatchNorm sums exchanged every layer); remaking, each takes whole micro-batches.
    With 2 GiB it can without remaking, and remaking would only cost time."""
    desc = describe_model("yolov2-16", 416)
    mem = MemoryModel.for_devices(desc, "sgd")
    tight = flops_cluster(desc, {f"d{i}": (50, "650 MiB") for i in range(4)})
    inputs = PlanInputs(desc, mem, tight, 32, 8)
    keeping, plan = _plan_auto(inputs), plan_auto(inputs)
    assert keeping.stages[0].mode == "dp" and not keeping.recomputes()
    assert plan.recomputes() and plan.stages[0].mode == "single" and plan.stages[0].replica_count() == 4
    again = simulate(plan, desc, mem, tight)
    assert again.fits and again.step_time == pytest.approx(plan.predicted["step_time_s"])
    assert again.step_time < 0.97 * keeping.predicted["step_time_s"]
    # the plan keeping everything would not fit with each device taking whole micro-batches
    whole = Plan.from_dict(plan.to_dict())
    whole.stages[0].recompute = None
    assert not simulate(whole, desc, mem, tight).fits
    roomy = flops_cluster(desc, {f"d{i}": (50, "2 GiB") for i in range(4)})
    assert not plan_auto(PlanInputs(desc, mem, roomy, 32, 8)).recomputes()
