"""Plans run by workers give the local trainer's weights (in-process network, no sockets).

Comparisons run in float64: float32 training of BN networks is only reproducible to ~1e-2
in zero-initialised tensors under any reordering of sums (two local runs with different
thread counts differ that much), so float32 would test luck, not logic. In float64 every
plan agrees with local to ~1e-12; pure pipelines (same batch, same kernels) are bit-exact
in float32 too.
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from planner.image_size import ImageSize
from planner.plan import Plan, Stage
from swarm.data import open_datasets, training_batch
from swarm.execution.inprocess import train_plan_in_process
from swarm.execution.stage import StageCopy
from swarm.local.trainer import LocalTrainer, TrainConfig

STEPS = 2


def _cfg(model: str, microbatches: int, dtype: str = "float64", img_size=64, **kw) -> TrainConfig:
    return TrainConfig(model=model, img_size=img_size, batch_size=8, microbatches=microbatches, seed=7, classes=5,
                       dtype=dtype, **{"accelerator": "cpu", **kw})  # local on the CPU, as the plans' devices


_LOCAL: dict[str, dict] = {}


def _local(cfg: TrainConfig, steps: int = STEPS) -> dict:
    """The local trainer's weights after `steps` (each config trained once per process; the
    weights are only read)."""
    key = repr((sorted(vars(cfg).items()), steps))
    if key not in _LOCAL:
        _LOCAL[key] = _train_locally(cfg, steps)
    return _LOCAL[key]


def _train_locally(cfg: TrainConfig, steps: int) -> dict:
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, cfg.img_size, 3)
    for s in range(steps):
        trainer.step(*training_batch(trainer, data, s))
    return trainer.net.state_dict()


def _planned(cfg: TrainConfig, plan: Plan, steps: int = STEPS, **kw) -> LocalTrainer:
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, cfg.img_size, 3)
    train_plan_in_process(plan, trainer, data, steps, timeout_s=120, **kw)
    return trainer


def _worst(a: dict, b: dict) -> tuple[float, str]:
    worst = (0.0, "")
    for k in a:
        if a[k].is_floating_point():
            d = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-30))
            worst = max(worst, (d, k))
        else:
            assert torch.equal(a[k], b[k]), k
    return worst


def _plan(model: str, stages: list[Stage], microbatches: int, img_size=64) -> Plan:
    return Plan(model, img_size, 8, microbatches, stages)


N16, N2 = 17, 31  # layers of yolov2-16 and yolov2

PLANS = {
    "pp4": lambda n: [Stage(0, 4, "single", ["d0"]), Stage(4, 9, "single", ["d1"]), Stage(9, 13, "single", ["d2"]),
                      Stage(13, n, "single", ["d3"])],
    "dp4": lambda n: [Stage(0, n, "dp", ["d0", "d1", "d2", "d3"], allocation={"d0": 1, "d1": 0, "d2": 1, "d3": 0})],
    "hybrid": lambda n: [Stage(0, 6, "single", ["d0"]), Stage(6, 12, "dp", ["d1", "d2"], allocation={"d1": 1, "d2": 1}),
                         Stage(12, n, "single", ["d3"])],
    "tiles2x2": lambda n: [Stage(0, n, "tiles", ["d0", "d1", "d2", "d3"], grid=(2, 2),
                                 tile_devices=["d0", "d1", "d2", "d3"])],
    "tiles-grouped-two-per-device": lambda n: [Stage(0, n, "tiles", ["d0", "d1"], grid=(2, 2),
                                                     tile_devices=["d0", "d1", "d1", "d0"], syncs=[0, 5, 11])],
    "tiles-all-together": lambda n: [Stage(0, n, "tiles", ["d0", "d1", "d2", "d3"], grid=(2, 2),
                                           tile_devices=["d0", "d1", "d2", "d3"], together=4)],
    "tiles-in-blocks-of-two-two-per-device": lambda n: [Stage(0, n, "tiles", ["d0", "d1"], grid=(1, 3),
                                                              tile_devices=["d0", "d1", "d0"], syncs=[0, 5, 11],
                                                              together=2)],
    "tiles-two-replicas-in-blocks-of-two": lambda n: [Stage(0, n, "tiles", ["d0", "d1", "d2", "d3"], grid=(1, 2),
                                                            tile_devices=["d0", "d1", "d2", "d3"], replicas=2,
                                                            together=2)],
    "tiles-four-replicas-of-one-tile": lambda n: [Stage(0, n, "tiles", ["d0", "d1", "d2", "d3"], grid=(1, 1),
                                                        tile_devices=["d0", "d1", "d2", "d3"], replicas=4)],
    "tiles-two-replicas-of-2x2-on-two-devices-each": lambda n: [
        Stage(0, n, "tiles", ["d0", "d1", "d2", "d3"], grid=(2, 2), syncs=[0, 5, 11], replicas=2,
              tile_devices=["d0", "d1", "d1", "d0", "d3", "d2", "d3", "d2"])],
    "four-replicas-of-one-device": lambda n: [Stage(0, n, "single", ["d0", "d1", "d2", "d3"], replicas=4)],
    "two-replicas-of-one-device": lambda n: [Stage(0, n, "single", ["d2", "d0"], replicas=2)],
    "three-replicas-with-uneven-shares": lambda n: [Stage(0, n, "single", ["d1", "d3", "d0"], replicas=3,
                                                          shares=[2, 1, 1])],
    "dp-replicas-of-groups-with-uneven-shares": lambda n: [
        Stage(0, n, "dp", ["d0", "d1", "d2", "d3"], allocation={"d0": 2, "d1": 1, "d2": 1, "d3": 2}, replicas=3,
              groups=[1, 2, 1], shares=[2, 1, 1])],
    "dp-two-replicas-of-two": lambda n: [Stage(0, n, "dp", ["d2", "d0", "d3", "d1"],
                                               allocation={"d2": 1, "d0": 1, "d3": 2, "d1": 0}, replicas=2)],
    "dp4-overlapped": lambda n: [Stage(0, n, "dp", ["d0", "d1", "d2", "d3"],
                                       allocation={"d0": 1, "d1": 0, "d2": 1, "d3": 0}, overlap=True)],
    "dp-replicas-of-groups-overlapped": lambda n: [
        Stage(0, n, "dp", ["d0", "d1", "d2", "d3"], allocation={"d0": 2, "d1": 1, "d2": 1, "d3": 2}, replicas=3,
              groups=[1, 2, 1], shares=[2, 1, 1], overlap=True)],
    "hybrid-overlapped": lambda n: [Stage(0, 6, "single", ["d0"]),
                                    Stage(6, 12, "dp", ["d1", "d2"], allocation={"d1": 1, "d2": 1}, overlap=True),
                                    Stage(12, n, "single", ["d3"])],
    "tiles-in-the-middle": lambda n: [Stage(0, 2, "single", ["d0"]),
                                      Stage(2, 12, "tiles", ["d1", "d2"], grid=(1, 2), tile_devices=["d1", "d2"]),
                                      Stage(12, n, "dp", ["d3", "d0"], allocation={"d3": 1, "d0": 1})],
    "first-and-last-on-one-device": lambda n: [Stage(0, 5, "single", ["d0"]), Stage(5, 12, "single", ["d1"]),
                                               Stage(12, n, "single", ["d0"])],
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_yolov2_16_plans_equal_local(name):
    cfg = _cfg("yolov2-16", 4)
    result = _planned(cfg, _plan("yolov2-16", PLANS[name](N16), 4))
    worst = _worst(result.net.state_dict(), _local(cfg))
    assert worst[0] < 1e-9, worst
    assert result.step_count == STEPS


@pytest.mark.parametrize("name", ["dp4", "dp-two-replicas-of-two", "hybrid"])
def test_overlapping_a_gang_changes_no_bit(name, monkeypatch):
    """A backward beside the next forward (Stage.overlap) keeps forwards in order and
    backwards in order, so float32 weights after real steps are the very bits of the same
    plan run one op at a time."""
    cfg = _cfg("yolov2-16", 4, dtype="float32")
    stages = PLANS[name](N16)
    plain = _planned(cfg, _plan("yolov2-16", stages, 4)).net.state_dict()
    spans = _compute_spans(monkeypatch)
    overlapped = _planned(cfg, _plan("yolov2-16", [replace(s, overlap=s.mode == "dp" or None) for s in stages], 4))
    for key, value in overlapped.net.state_dict().items():
        assert torch.equal(value, plain[key]), key
    # and, in a one-stage plan (where a forward's inputs never wait on another stage), a
    # forward did compute while a backward on the same device was under way
    if len(stages) == 1:
        assert any(b[0] == f[0] and b[2] < f[2] < b[3] for b in spans["B"] for f in spans["F"]), spans


OVERLAPPING = ["pp4", "dp4", "hybrid", "hybrid-overlapped", "four-replicas-of-one-device",
               "three-replicas-with-uneven-shares", "dp-replicas-of-groups-with-uneven-shares", "tiles-in-the-middle"]


@pytest.mark.parametrize("name", OVERLAPPING)
def test_steps_over_the_step_befores_sums_change_no_bit(name):
    """Between backups a step starts while the step before's sums travel, each layer waiting
    for its own bucket's update (worker.Tail); with a backup at every step each step waits for
    all of them. Float32 weights and running statistics after four real steps are the same
    bits either way (a device with a tiles stage settles every step, beside devices that
    do not), and equal local training in float64."""
    cfg = _cfg("yolov2-16", 4, dtype="float32")
    plan = _plan("yolov2-16", PLANS[name](N16), 4)
    settled = _planned(cfg, plan, steps=4, backup_interval=1).net.state_dict()
    overlapped = _planned(cfg, plan, steps=4, backup_interval=1000).net.state_dict()
    for key, value in overlapped.items():
        assert torch.equal(value, settled[key]), key
    cfg64 = _cfg("yolov2-16", 4)
    worst = _worst(_planned(cfg64, plan, steps=4, backup_interval=1000).net.state_dict(), _local(cfg64, 4))
    assert worst[0] < 1e-9, worst


def test_the_next_forward_computes_before_the_step_befores_last_update(monkeypatch):
    """The overlap is real: with the top layers' update held back, each device's next forward
    has passed its first layer (whose own update came first) before that update is applied."""
    events = []
    apply_params, build = StageCopy.apply_params, StageCopy.build

    def slow_top(self, step, params, commit=True):
        top = {id(q) for q in self.net.layers[self.stage.last - 1].parameters()}
        if any(id(q) in top for q in params):
            time.sleep(0.3)
        apply_params(self, step, params, commit)
        if any(id(q) in top for q in params):
            events.append(("applied", id(self), time.perf_counter()))

    def built(*args, **kw):
        copy = build(*args, **kw)
        copy.net.layers[0].register_forward_hook(lambda *_: events.append(("layer0", id(copy), time.perf_counter())))
        return copy
    monkeypatch.setattr(StageCopy, "apply_params", slow_top)
    monkeypatch.setattr(StageCopy, "build", built)
    cfg = _cfg("yolov2-16", 4, dtype="float32")
    _planned(cfg, _plan("yolov2-16", PLANS["four-replicas-of-one-device"](N16), 4), steps=3, backup_interval=1000)
    early = 0
    for copy in {c for _, c, _ in events}:
        mine = sorted((t, kind) for kind, c, t in events if c == copy)
        forwards = [t for t, kind in mine if kind == "layer0"]  # one micro-batch a step: step k's is the k-th
        applied = [t for t, kind in mine if kind == "applied"]
        assert len(forwards) == 3 and len(applied) == 3, mine
        early += sum(forwards[k + 1] < applied[k] for k in range(2))
    assert early >= 4, events  # of the 8 (two steps after another on four devices): all, unless a host stalls


def test_the_samples_sent_ahead_wait_for_the_sums_on_the_links(monkeypatch):
    """A step's samples go out while the step before runs, but only once every device's sums
    of the step before that are done (they share the links): with the top layers' update
    held back, each step's samples from the third on leave after every device's tail of the
    step two before it has ended, and the weights are still the settled run's bits."""
    from swarm.execution.coordinator import TrainingCoordinator as Coordinator
    from swarm.execution.worker import DeviceWorker
    cfg = _cfg("yolov2-16", 4, dtype="float32")
    plan = _plan("yolov2-16", PLANS["four-replicas-of-one-device"](N16), 4)
    settled = _planned(cfg, plan, steps=4, backup_interval=1).net.state_dict()
    fed, tails = {}, {}
    apply_params, feed, finish_tail = StageCopy.apply_params, Coordinator.feed, DeviceWorker.finish_tail

    def slow_top(self, step, params, commit=True):
        top = {id(q) for q in self.net.layers[self.stage.last - 1].parameters()}
        if any(id(q) in top for q in params):
            time.sleep(0.3)
        apply_params(self, step, params, commit)

    async def fed_at(self, step, batch):
        await feed(self, step, batch)
        fed[step] = time.perf_counter()  # (the sends start after the wait, and end here)

    async def tail_ends(self, tail, decision):
        await finish_tail(self, tail, decision)
        tails.setdefault(tail.step, []).append(time.perf_counter())
    monkeypatch.setattr(StageCopy, "apply_params", slow_top)
    monkeypatch.setattr(Coordinator, "feed", fed_at)
    monkeypatch.setattr(DeviceWorker, "finish_tail", tail_ends)
    overlapped = _planned(cfg, plan, steps=4, backup_interval=1000).net.state_dict()
    assert sorted(fed) == [0, 1, 2, 3], fed
    for step in (2, 3):
        assert len(tails[step - 2]) == 4 and fed[step] > max(tails[step - 2]), (step, fed, tails)
    for key, value in overlapped.items():
        assert torch.equal(value, settled[key]), key


def test_a_stage_computes_its_next_micro_batch_while_its_activations_travel(monkeypatch):
    """What a stage sends the next one goes while it computes on: with the delivery of each
    step's first activations held back until the first stage starts sending its second
    micro-batch's (or HELD_S, which a stage that waits on each send would spend), the second
    has started before the first has arrived, in every step; and the weights are still the
    local run's. (Held a fixed 0.3 s instead, a loaded host's forward outlasted it.)"""
    import trio

    from swarm.execution.endpoint import LocalEndpoint
    HELD_S = 20.0
    starts, ends, started = {}, {}, {}
    send = LocalEndpoint.send

    async def slow_acts(self, dst, key, payload):
        if key[0] != "act" or key[2] != 1:  # (the first stage's outputs, to the second)
            return await send(self, dst, key, payload)
        step, m = key[1], key[4]
        starts[step, m] = time.perf_counter()
        started.setdefault((step, m), trio.Event()).set()
        if m == 0:
            with trio.move_on_after(HELD_S):
                await started.setdefault((step, 1), trio.Event()).wait()
        await send(self, dst, key, payload)
        ends[step, m] = time.perf_counter()
    monkeypatch.setattr(LocalEndpoint, "send", slow_acts)
    cfg = _cfg("yolov2-16", 4)
    result = _planned(cfg, _plan("yolov2-16", PLANS["pp4"](N16), 4))
    assert sorted(starts) == [(s, m) for s in range(STEPS) for m in range(4)], starts
    for step in range(STEPS):
        assert starts[step, 1] < ends[step, 0], (step, starts, ends)
    worst = _worst(result.net.state_dict(), _local(cfg))
    assert worst[0] < 1e-9, worst


def test_a_device_that_never_ends_its_sums_ends_the_run_in_one_line(monkeypatch):
    """The samples sent ahead wait for every device's sums of the step before; before a backup
    (where the plan may change) the coordinator waits for them to be out, up to the job's
    timeout: a device that reports its steps ready but never its sums ends the run in one
    line that names it."""
    import re

    from swarm.errors import SwarmError
    from swarm.execution import channels, worker

    class Unsent:
        def __getattr__(self, name):
            return getattr(channels, name)

        @staticmethod
        def summed(step: int, device: str):
            return ("not-summed", step, device) if device == "d1" else channels.summed(step, device)
    monkeypatch.setattr(worker, "channels", Unsent())
    cfg = _cfg("yolov2-16", 4, dtype="float32")
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, cfg.img_size, 3)
    with pytest.raises(SwarmError) as caught:
        train_plan_in_process(_plan("yolov2-16", PLANS["four-replicas-of-one-device"](N16), 4), trainer, data, 4,
                              timeout_s=6, backup_interval=1)  # (2 s: as tight as a loaded host's steps)
    assert type(caught.value) is SwarmError
    assert re.fullmatch(r"d1 did not finish its gradient sums of step 1 within 6 s, yet still counts as alive; "
                        r"training stopped after step 2", str(caught.value)), str(caught.value)


def test_a_late_merge_of_running_statistics_still_starts_the_next_ones(monkeypatch):
    """A step's running statistics, merged while the next step runs, are that step's start:
    with the first step's merge held back past the second step's end, the result is the
    same bits as with every step settled."""
    cfg = _cfg("yolov2-16", 4, dtype="float32")
    plan = _plan("yolov2-16", PLANS["three-replicas-with-uneven-shares"](N16), 4)
    settled = _planned(cfg, plan, steps=3, backup_interval=1).net.state_dict()
    merged_running, calls = StageCopy.merged_running, {}

    def late_first(self, moved, shares):
        calls[id(self)] = calls.get(id(self), 0) + 1
        if calls[id(self)] == 1:
            time.sleep(1.0)
        return merged_running(self, moved, shares)
    monkeypatch.setattr(StageCopy, "merged_running", late_first)
    late = _planned(cfg, plan, steps=3, backup_interval=1000).net.state_dict()
    for key, value in late.items():
        assert torch.equal(value, settled[key]), key


def _compute_spans(monkeypatch) -> dict[str, list[tuple]]:
    """(device's stage copy, micro-batch, start, end) of every forward and backward computed."""
    spans = {"F": [], "B": []}
    for kind, name in (("F", "forward"), ("B", "backward")):
        inner = getattr(StageCopy, name)

        def timed(self, part, m, *args, _inner=inner, _kind=kind, **kw):
            start = time.perf_counter()
            try:
                return _inner(self, part, m, *args, **kw)
            finally:
                spans[_kind].append((id(self), m, start, time.perf_counter()))
        monkeypatch.setattr(StageCopy, name, timed)
    return spans


WIDE = ImageSize(64, 32)  # maps 32x64 down to a 2x4 grid of cells


@lru_cache(maxsize=None)
def _local_wide() -> dict:
    return _local(_cfg("yolov2-16", 4, img_size=WIDE))


@pytest.mark.parametrize("name", ["pp4", "dp4", "hybrid", "tiles2x2", "tiles-in-the-middle"])
def test_yolov2_16_plans_equal_local_on_a_rectangular_input(name):
    """Single, dp and tiles stages at 64x32, over maps twice as wide as they are tall: four
    single-device stages; one dp group; one device, a dp pair, one device; a 2x2 grid over the
    whole network; one device, a 1x2 grid, a dp pair."""
    result = _planned(_cfg("yolov2-16", 4, img_size=WIDE), _plan("yolov2-16", PLANS[name](N16), 4, WIDE))
    worst = _worst(result.net.state_dict(), _local_wide())
    assert worst[0] < 1e-9, worst
    assert result.desc.layers[-1].out_shape[1:] == (2, 4)


@pytest.mark.slow
@lru_cache(maxsize=None)
def _local_yolov2() -> dict:
    """The full yolov2's local run (2 micro-batches of 4), shared by the tests below."""
    return _local(_cfg("yolov2", 2))


def test_full_yolov2_dp_equals_local():
    """yolov2's passthrough (layer 16 read by layer 25) inside a dp group (pipelines that
    cut it run on the testbed: tests/test_swarm_training.py)."""
    group = Stage(0, N2, "dp", ["d0", "d1"], allocation={"d0": 2, "d1": 2})
    result = _planned(_cfg("yolov2", 2), _plan("yolov2", [group], 2))
    assert _worst(result.net.state_dict(), _local_yolov2())[0] < 1e-9


def test_pure_pipeline_is_bit_exact_in_float32():
    cfg = _cfg("yolov2-16", 4, dtype="float32")
    result = _planned(cfg, _plan("yolov2-16", PLANS["pp4"](N16), 4))
    assert _worst(result.net.state_dict(), _local(cfg))[0] == 0.0


SMALL_CLASSIFIER = """[net]
width=32
height=32
channels=3

[convolutional]
batch_normalize=1
filters=8
size=3
stride=2
pad=1
activation=leaky

[maxpool]
size=2
stride=2

[connected]
output=32
batch_normalize=1
activation=leaky

[dropout]
probability=0.5

[connected]
output=5
activation=linear

[softmax]
"""


def test_dp_with_dropout_batchnorm_vectors_and_uneven_shares(tmp_path):
    """Dropout masks follow the sample, not the device; BatchNorm of vectors is exact across
    a dp group too."""
    path = tmp_path / "small.cfg"
    path.write_text(SMALL_CLASSIFIER)
    cfg = TrainConfig(model=str(path), img_size=32, batch_size=6, microbatches=2, seed=3, dtype="float64")
    plan = Plan(str(path), 32, 6, 2, [Stage(0, 2, "single", ["a"]),
                                      Stage(2, 5, "dp", ["b", "c"], allocation={"b": 2, "c": 1})])
    result = _planned(cfg, plan)
    assert _worst(result.net.state_dict(), _local(cfg))[0] < 1e-9


def test_optimizer_state_comes_back_for_resume():
    cfg = _cfg("yolov2-16", 2)
    plan = _plan("yolov2-16", [Stage(0, 8, "single", ["a"]), Stage(8, N16, "dp", ["b", "c"],
                                                                      allocation={"b": 2, "c": 2})], 2)
    planned = _planned(cfg, plan)
    local = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, 64, 3)
    for s in range(STEPS):
        local.step(*training_batch(local, data, s))
    ours, theirs = planned.optimizer.state_dict(), local.optimizer.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for k, st in theirs["state"].items():
        assert torch.allclose(ours["state"][k]["momentum_buffer"], st["momentum_buffer"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["dp", "pp", "tiles", "hybrid"])
def test_simple_strategies_equal_local(strategy):
    from planner.baselines import simple_plan

    cfg = _cfg("yolov2-16", 2)
    plan = simple_plan(strategy, LocalTrainer(TrainConfig(**vars(cfg))).desc, ["d0", "d1", "d2", "d3"], 8, 2)
    assert _worst(_planned(cfg, plan).net.state_dict(), _local(cfg))[0] < 1e-9


@pytest.mark.slow
def test_full_yolov2_tiles_front_then_pipeline():
    cfg = _cfg("yolov2", 2)
    plan = _plan("yolov2", [Stage(0, 17, "tiles", ["d0", "d1", "d2", "d3"], grid=(2, 2),
                                  tile_devices=["d0", "d1", "d2", "d3"]),
                            Stage(17, 25, "single", ["d1"]), Stage(25, N2, "single", ["d2"])], 2)
    assert _worst(_planned(cfg, plan).net.state_dict(), _local_yolov2())[0] < 1e-9


def test_strategy_mistakes_are_plan_errors():
    from planner.baselines import simple_plan
    from planner.plan import PlanError
    from swarm.zoo import describe_model

    desc = describe_model("yolov2-16", 64, classes=5)
    with pytest.raises(PlanError, match="--stages 5 needs 5 devices"):
        simple_plan("pp", desc, ["a", "b"], 8, 2, stages=5)
    with pytest.raises(PlanError, match="split evenly"):
        simple_plan("dp", desc, ["a", "b"], 7, 2)
    with pytest.raises(PlanError, match="--sync"):
        simple_plan("tiles", desc, ["a", "b"], 8, 2, sync="x")
    with pytest.raises(PlanError, match="does not fit"):
        simple_plan("tiles", desc, ["a", "b"], 8, 2, grid=(8, 8))
    with pytest.raises(PlanError, match="--replicas 3 needs at least 3 devices"):
        simple_plan("tiles", desc, ["a", "b"], 8, 2, replicas=3)
    with pytest.raises(PlanError, match="--replicas 4 must divide the 2 micro-batches"):
        simple_plan("tiles", desc, ["a", "b", "c", "d"], 8, 2, replicas=4)


def test_dp_gives_whole_micro_batches_to_devices_when_that_keeps_more_busy():
    from planner.baselines import simple_plan
    from swarm.zoo import describe_model

    desc = describe_model("yolov2-16", 64, classes=5)
    devices = [f"d{i}" for i in range(8)]
    eight = simple_plan("dp", desc, devices, 8, 8).stages[0]  # one sample per micro-batch: one device each
    assert (eight.mode, eight.devices, eight.replicas) == ("single", devices, 8)
    six = simple_plan("dp", desc, devices[:6], 8, 8).stages[0]  # as many as divide the micro-batches
    assert (six.mode, six.devices, six.replicas) == ("single", devices[:4], 4)
    shared = simple_plan("dp", desc, devices[:4], 16, 4).stages[0]  # four samples each: shared by four
    assert (shared.mode, shared.allocation) == ("dp", {d: 1 for d in devices[:4]})
    forced = simple_plan("dp", desc, devices[:4], 16, 4, replicas=2).stages[0]
    assert (forced.mode, forced.devices, forced.replicas) == ("single", devices[:2], 2)
    grids = simple_plan("tiles", desc, devices, 8, 8, replicas=2).stages[0]
    assert grids.grid == (2, 2) and grids.replica_tiles(1) == devices[4:] and grids.together == 1  # memory unknown


@pytest.mark.parametrize("gpipe", [False, True])
def test_1f1b_holds_at_most_k_p_microbatches(monkeypatch, gpipe):
    """Stage p keeps the activations of at most K_p = 2(P - p) - 1 micro-batches (all M under GPipe)."""
    from swarm.execution.stage import StageCopy

    peaks: dict[int, int] = {}
    forward = StageCopy.forward

    def counting(self, *args, **kw):
        out = forward(self, *args, **kw)
        peaks[self.p] = max(peaks.get(self.p, 0), len(self.inflight))
        return out

    monkeypatch.setattr(StageCopy, "forward", counting)
    m = 8
    cfg = TrainConfig(model="yolov2-16", img_size=32, batch_size=8, microbatches=m, seed=1, classes=5)
    stages = PLANS["pp4"](N16)
    if gpipe:
        for s in stages:
            s.warmup = m
    plan = Plan("yolov2-16", 32, 8, m, stages)
    _planned(cfg, plan, steps=1)
    expected = [m] * 4 if gpipe else [min(2 * (4 - p) - 1, m) for p in range(4)]
    assert [peaks[p] for p in range(4)] == expected  # [7, 5, 3, 1] with 1F1B


def test_gradient_buckets_gather_small_layers_from_the_top():
    from planner.buckets import buckets_of

    sizes = {0: 10, 2: 600, 3: 500, 5: 2000, 6: 100, 7: 950}
    assert buckets_of(sizes, least=1000) == [[7, 6], [5], [3, 2], [0]]
    assert buckets_of({}, least=1000) == []
    assert buckets_of(sizes, least=1) == [[7], [6], [5], [3], [2], [0]]


def test_the_lanes_sum_in_the_plans_order_whatever_the_precision():
    """A plan names its stage's float32 buckets (Stage.sum_order); a float64 run cuts them
    finer, and each of its buckets takes the turn of the plan's bucket that holds its top
    layer, the same on every member."""
    import trio

    from planner.buckets import sum_sequence
    from swarm.execution.endpoint import LocalNetwork
    from swarm.execution.reduce import GradReducer
    from swarm.zoo import build_model

    assert sum_sequence([16, 13, 10, 9, 6], None) == [16, 13, 10, 9, 6]
    assert sum_sequence([16, 13, 10, 9, 6], [16, 10, 9, 6, 13]) == [16, 10, 9, 6, 13]
    net = build_model("yolov2-16", 64, seed=1)[0].double()
    orders = []

    async def main():
        async with trio.open_nursery() as nursery:
            for sum_order in (None, [16, 10, 9, 6, 13]):
                reducer = GradReducer(LocalNetwork().endpoint("a"), ["a", "b"], ("grads", 0, 0), net, 0, 17, nursery,
                                      sum_order=sum_order)
                orders.append((list(reducer.buckets.values()), reducer.order))
    trio.run(main)
    buckets = [[16, 15], [14], [13], [12], [10], [9, 8], [6, 5, 4], [2, 0]]
    assert orders == [(buckets, [16, 14, 13, 12, 10, 9, 6, 2]), (buckets, [16, 14, 10, 9, 6, 2, 13, 12])]


def test_a_runs_plan_line_names_each_replicas_share():
    def one_stage(stage):
        return Plan("lenet5", 32, 4, 4, [stage], devices={"a": {}, "b": {}})

    uneven = one_stage(Stage(0, 7, "single", ["a", "b"], replicas=2, shares=[3, 1])).describe()
    assert "2 replicas taking a:3,b:1 micro-batches on a, b" in uneven
    even = one_stage(Stage(0, 7, "single", ["a", "b"], replicas=2)).describe()
    assert "2 replicas of 2 micro-batch(es) each" in even
    assert "remade" not in even and "checkpointed" not in even
    # what a stage keeps for its backward is part of its line
    remade = one_stage(Stage(0, 7, "single", ["a", "b"], replicas=2, shares=[3, 1], recompute=True)).describe()
    assert "2 replicas taking a:3,b:1 micro-batches, BatchNorm remade in the backward on a, b" in remade
    segments = one_stage(Stage(0, 7, "single", ["a"], checkpoint=True)).describe()
    assert "layers 0-6 single, in checkpointed segments on a" in segments


def test_consecutive_stages_on_one_device_hand_over_without_the_host(monkeypatch):
    """d0 runs stages 0 and 1, d1 stage 2: the stage 0 -> 1 hand-off is the tensor stage 0
    computed, never brought to the host; only what crosses to d1 (activations forward, their
    gradients back) goes through `to_host`, once per message. The weights are local training's."""
    from swarm.execution import blocks, stage
    from swarm.local.compute_device import to_host

    cfg = _cfg("yolov2-16", 2)
    plan = _plan("yolov2-16", [Stage(0, 6, "single", ["d0"]), Stage(6, 12, "single", ["d0"]),
                               Stage(12, N16, "single", ["d1"])], 2)
    to_host_calls = []
    monkeypatch.setattr(blocks, "to_host", lambda t: to_host_calls.append(tuple(t.shape[1:])) or to_host(t))
    monkeypatch.setattr(stage, "to_host", lambda t: pytest.fail("a stage brought its tensors to the host"))
    outputs, inputs = {}, {}
    forward = stage.StageCopy.forward

    def spied(self, part, m, given, keys, *args):
        inputs[(self.p, m, len(outputs))] = {k: t.data_ptr() for k, t in given.items()}
        out = forward(self, part, m, given, keys, *args)
        outputs[(self.p, m, len(outputs))] = {k: t.data_ptr() for k, t in out.items()}
        return out

    monkeypatch.setattr(stage.StageCopy, "forward", spied)
    result = _planned(cfg, plan)
    assert _worst(result.net.state_dict(), _local(cfg))[0] < 1e-9
    handed = [(key, ptrs) for key, ptrs in inputs.items() if key[0] == 1]
    assert handed and all(ptrs[5] in {o[5] for k, o in outputs.items() if k[0] == 0 and k[1] == key[1]}
                          for key, ptrs in handed)
    crossing = result.desc.layers[11].out_shape
    assert to_host_calls == [crossing] * (2 * 2 * STEPS)  # 2 micro-batches, forward and backward, per step
