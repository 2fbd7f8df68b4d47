"""Graph networks — residual adds, CSP route groups, heads at several depths — in every plan:
each gives the local trainer's weights after real optimizer steps in float64 (in process), a
cut carries every map that crosses it (the bytes the planner counts are the bytes sent), and
the memory model's estimate is what autograd keeps.

The cfgs in tests/cfg/darknet/ are darknet's own (public domain), at small sizes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.memory import MemoryModel
from planner.plan import Plan, Stage
from swarm.errors import SwarmError
from swarm.zoo import build_model, describe_model
from tests.test_execution import _cfg, _local, _planned, _worst

CFG = Path(__file__).resolve().parent / "cfg" / "darknet"
SIZE = 64


def _model(name: str) -> str:
    return str(CFG / f"{name}.cfg")


# Per network: layers, and pipeline cuts of four stages with one cut inside a block (a skip
# crosses it) and one across a route or a head (several maps cross it).
NETWORKS = {
    # yolov3-tiny: the route at 20 reads layer 8, so the cut at 12 carries 8 beside 12's map, and
    # the cut at 20 carries the first head (16) beside 19 and 8
    "yolov3-tiny": (24, [6, 12, 20]),
    # yolov4-tiny: 5 is inside the first CSP block (2, 4 and 5 cross it); 13 inside the second
    # (10, 12, 13); 33 after the first head (23, 30 and 33 cross)
    "yolov4-tiny": (38, [5, 13, 33]),
    # resnet18: 3 and 9 each split a residual block (the skip from 1, from 7, crosses with the map)
    "resnet18": (28, [3, 9, 21]),
}


def _stages(kind: str, n: int, cuts: list[int]) -> list[Stage]:
    bounds = [0, *cuts, n]
    if kind == "pp4":
        return [Stage(a, b, "single", [f"d{i}"]) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    if kind == "dp":
        return [Stage(0, n, "dp", ["d0", "d1", "d2"], allocation={"d0": 2, "d1": 1, "d2": 1})]
    if kind == "hybrid":
        return [Stage(0, cuts[0], "single", ["d0"]),
                Stage(cuts[0], cuts[1], "dp", ["d1", "d2"], allocation={"d1": 3, "d2": 1}),
                Stage(cuts[1], n, "single", ["d3"])]
    if kind == "replicas":  # two devices each taking whole micro-batches
        return [Stage(0, n, "single", ["d0", "d1"], replicas=2)]
    if kind == "replicated-pp":  # a pipeline whose stages are replicas taking whole micro-batches:
        # two of the front (unequal shares), one device, a dp replica group of two beside one device
        return [Stage(0, cuts[0], "single", ["d0", "d1"], replicas=2, shares=[3, 1]),
                Stage(cuts[0], cuts[1], "single", ["d2"]),
                Stage(cuts[1], n, "dp", ["d3", "d4", "d1"], allocation={"d3": 1, "d4": 1, "d1": 2}, replicas=2,
                      groups=[2, 1], shares=[1, 3])]
    if kind == "replicas-in-turns":  # the same, the replicas taking the micro-batches in turn
        return [Stage(0, cuts[0], "single", ["d0", "d1"], replicas=2, shares=[3, 1], deal="turns"),
                Stage(cuts[0], cuts[1], "single", ["d2"]),
                Stage(cuts[1], n, "dp", ["d3", "d4", "d1"], allocation={"d3": 1, "d4": 1, "d1": 2}, replicas=2,
                      groups=[2, 1], shares=[1, 3], deal="turns")]
    raise AssertionError(kind)


@pytest.fixture(scope="module")
def local_weights():
    cache = {}

    def weights(name: str, microbatches: int = 2):
        if (name, microbatches) not in cache:
            cache[name, microbatches] = _local(_cfg(_model(name), microbatches, img_size=SIZE))
        return cache[name, microbatches]
    return weights


@pytest.mark.parametrize("kind", ["pp4", "dp", "hybrid", "replicas", "replicated-pp", "replicas-in-turns"])
@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_a_graph_network_trains_to_the_local_weights_in_every_plan(local_weights, name, kind):
    n, cuts = NETWORKS[name]
    microbatches = 4 if kind in ("replicated-pp", "replicas-in-turns") else 2
    cfg = _cfg(_model(name), microbatches, img_size=SIZE)
    trainer = _planned(cfg, Plan(cfg.model, SIZE, 8, microbatches, _stages(kind, n, cuts)))
    worst, key = _worst(trainer.net.state_dict(), local_weights(name, microbatches))
    assert worst < 1e-9, (key, worst)


def test_tiles_in_front_of_a_graph_network_then_a_pipeline_equal_local(local_weights):
    """Tiles take resnet18's front up to where the first subsampled add begins: the first conv,
    the max-pool and both residual blocks of 64 channels; the blocks behind run as pipeline
    stages."""
    from tiles.layout import tileable_prefix

    desc = describe_model(_model("resnet18"), SIZE, classes=5)
    front = tileable_prefix(desc)
    assert front == 8  # conv, max-pool, two blocks; the block at 8-10 adds a subsampled map
    stages = [Stage(0, front, "tiles", ["d0", "d1", "d2", "d3"], grid=(2, 2), tile_devices=["d0", "d1", "d2", "d3"]),
              Stage(front, 9, "single", ["d1"]), Stage(9, 28, "single", ["d2"])]
    cfg = _cfg(_model("resnet18"), 2, img_size=SIZE)
    trainer = _planned(cfg, Plan(cfg.model, SIZE, 8, 2, stages))
    worst, key = _worst(trainer.net.state_dict(), local_weights("resnet18"))
    assert worst < 1e-9, (key, worst)


def test_a_tiles_stage_ending_inside_a_residual_block_is_refused_in_one_line():
    """Layers 0-2 end inside the first block: the skip from the max-pool's map (layer 1) leaves
    the stage for the shortcut at 4, and a tiles stage passes on only its last map."""
    desc = describe_model(_model("resnet18"), SIZE, classes=5)
    plan = Plan(_model("resnet18"), SIZE, 8, 2, [Stage(0, 3, "tiles", ["d0", "d1"], grid=(1, 2), tile_devices=["d0", "d1"]),
                                                 Stage(3, 28, "single", ["d2"])])
    with pytest.raises(ValueError, match="tiles.*layer 1's map inside the stage is read after it by layer 4") as err:
        plan.validate(desc)
    assert "\n" not in str(err.value)


def test_a_pipeline_loses_a_device_and_replays_to_the_local_weights(local_weights):
    n, cuts = NETWORKS["yolov4-tiny"]
    cfg = _cfg(_model("yolov4-tiny"), 2, img_size=SIZE)
    trainer = _planned(cfg, Plan(cfg.model, SIZE, 8, 2, _stages("pp4", n, cuts)), steps=3,
                       events=[(1, "kill", "d1", 0.0)])
    worst, key = _worst(trainer.net.state_dict(), _local(cfg, steps=3))
    assert worst < 1e-9, (key, worst)


def test_a_replicated_pipeline_loses_a_replica_and_replays_to_the_local_weights():
    """resnet18 with its front as two replicas taking whole micro-batches ahead of two single
    stages; one replica's device is lost after step 1: the survivors re-plan, replay, and end
    where local training does."""
    n, cuts = NETWORKS["resnet18"]
    cfg = _cfg(_model("resnet18"), 4, img_size=SIZE)
    stages = [Stage(0, cuts[1], "single", ["d0", "d1"], replicas=2), Stage(cuts[1], cuts[2], "single", ["d2"]),
              Stage(cuts[2], n, "single", ["d3"])]
    trainer = _planned(cfg, Plan(cfg.model, SIZE, 8, 4, stages), steps=3, events=[(1, "kill", "d1", 0.0)])
    worst, key = _worst(trainer.net.state_dict(), _local(cfg, steps=3))
    assert worst < 1e-9, (key, worst)


def test_a_cuts_bytes_as_the_planner_counts_them_are_the_bytes_the_run_sends(monkeypatch):
    """Every activation and gradient block sent between stages is counted; per micro-batch and
    cut, forward they are the planner's boundary bytes (float64 here: twice float32's), and
    backward the same less the maps that take no gradient (the image)."""
    from swarm.execution import blocks

    sent: dict[tuple[str, int], int] = {}
    real_init = blocks.BlockPost.__init__

    class Counting:
        def __init__(self, ep):
            self._ep = ep

        def __getattr__(self, name):
            return getattr(self._ep, name)

        async def send(self, device, key, msg):
            if key[0] in ("act", "grad"):
                cut = key[2] if key[0] == "act" else key[2] + 1  # the stage after the cut
                sent[(key[0], cut)] = sent.get((key[0], cut), 0) + msg["arrays"][0].nbytes
            return await self._ep.send(device, key, msg)

    def init(self, ep, *args, **kw):
        real_init(self, Counting(ep), *args, **kw)

    monkeypatch.setattr(blocks.BlockPost, "__init__", init)
    n, cuts = NETWORKS["yolov3-tiny"]
    cfg = _cfg(_model("yolov3-tiny"), 2, img_size=SIZE)
    steps = 2
    _planned(cfg, Plan(cfg.model, SIZE, 8, 2, _stages("pp4", n, cuts)), steps=steps)
    desc = describe_model(_model("yolov3-tiny"), SIZE, classes=5)
    samples = 8 * steps
    for p, cut in enumerate(cuts, start=1):
        planned = desc.boundary_bytes(cut) * 2 * samples  # float64 maps
        assert sent[("act", p)] == planned, (cut, sent[("act", p)], planned)
        assert sent[("grad", p)] == planned, (cut, sent[("grad", p)], planned)
    assert len(desc.live_after(20)) == 3  # the first head, the upsampled map and layer 8 cross the last cut


@pytest.mark.parametrize("name", ["resnet18", "yolov4-tiny", "efficientnet_b0", "yolov3-tiny", "darknet53"])
def test_the_memory_estimate_is_what_autograd_keeps_on_a_graph_network(name):
    """The shape-based estimate the planner uses before a profile, against the bytes autograd
    saves layer by layer (swarm.profiling.saved_bytes)."""
    import torch

    from swarm.profiling.saved_bytes import saved_bytes

    net, desc, _ = build_model(_model(name), SIZE, classes=5, seed=1)
    net.train()
    x = torch.randint(0, 255, (2, 3, SIZE, SIZE), dtype=torch.uint8)
    live = {-1: x}
    with torch.no_grad():
        for i in range(len(desc)):
            live.update(net.forward_range(i, i + 1, {s: live[s] for s in desc.live_after(i)}, [0, 1]))
    measured = np.array(saved_bytes(net, desc, live, 2))
    estimate = MemoryModel.estimated(desc).act_bytes
    assert np.allclose(measured, estimate, rtol=0.05, atol=16384), \
        [(i, desc.layers[i].kind, m, e) for i, (m, e) in enumerate(zip(measured, estimate)) if abs(m - e) > 16384]
    assert sum(measured) == pytest.approx(sum(estimate), rel=0.05)


def test_a_head_computed_early_travels_to_the_loss_with_the_maps():
    desc = describe_model(_model("yolov3-tiny"), SIZE, classes=5)
    assert desc.outputs == (16, 23)
    assert 16 in desc.live_after(17) and 16 in desc.live_after(23) and desc.live_after(24) == (16, 23)
    assert desc.boundary_bytes(24) == desc.layers[16].out_bytes + desc.layers[23].out_bytes


def test_a_grouped_or_dilated_window_ends_the_tileable_front():
    from tiles.layout import tileable_prefix

    desc = describe_model(_model("efficientnet_b0"), SIZE, classes=5)
    first_grouped = next(layer.index for layer in desc.layers if layer.groups > 1)
    assert 0 < tileable_prefix(desc) <= first_grouped
    with pytest.raises(SwarmError, match="groups=3 must divide"):
        describe_model("x.cfg", 8, cfg_text="[net]\nwidth=8\nchannels=4\n[convolutional]\nfilters=6\ngroups=3\n")


def test_a_graph_network_switching_to_a_re_costed_plan_ends_with_the_local_weights():
    """auto's re-costing on a graph network: dp over four devices, then (at a backup step) a
    pipeline over two whose cut three maps cross."""
    from planner.baselines import simple_plan
    from swarm.data import open_datasets
    from swarm.execution.inprocess import train_plan_in_process
    from swarm.local.trainer import LocalTrainer, TrainConfig
    from tests.test_recost import _Switch

    steps = 4
    cfg = _cfg(_model("yolov4-tiny"), 2, img_size=SIZE)
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, SIZE, 3)
    first = simple_plan("dp", trainer.desc, ["d0", "d1", "d2", "d3"], 8, 2)
    second = Plan(cfg.model, SIZE, 8, 2, [Stage(0, 33, "single", ["d2"]), Stage(33, 38, "single", ["d0"])])
    assert trainer.desc.live_after(33) == (23, 30, 32)  # a skip, the first head and the map before the cut
    switch = _Switch(second)
    coordinator = train_plan_in_process(first, trainer, data, steps, strategy="dp", timeout_s=120, recost=switch,
                                        devices=["d0", "d1", "d2", "d3"])
    assert [r.how for r in coordinator.recoveries] == ["recost"]
    assert coordinator.plan.used_devices() == ["d2", "d0"]
    worst, key = _worst(trainer.net.state_dict(), _local(cfg, steps=steps))
    assert worst < 1e-9, (key, worst)


def test_a_network_whose_front_tiles_cannot_take_is_refused_in_one_line():
    from planner.baselines import simple_plan
    from planner.plan import PlanError

    desc = describe_model(_model("vgg-16"), 256)  # [crop] first
    for strategy in ("tiles", "hybrid"):
        with pytest.raises(PlanError, match=r"starts with layer 0 \(crop\), which tiles cannot take") as err:
            simple_plan(strategy, desc, ["d0", "d1", "d2", "d3"], 8, 2)
        assert "\n" not in str(err.value)
