"""Plans that cannot fit their devices' memory are refused before any device runs out of it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from planner.backups import backup_holders
from planner.baselines import simple_plan
from planner.memory_fit import RUNTIME_FLOOR, describe, memory_overflows
from planner.plan import PlanError
from planner.replan import replan
from swarm.errors import SwarmError
from swarm.execution.launch import SwarmOptions, SwarmRunner
from swarm.local.trainer import TrainConfig
from swarm.zoo import describe_model

GIB = 2**30
EIGHT = [f"dev{k}" for k in range(8)]


def _pi(names, memory=GIB):
    return {n: {"memory": memory} for n in names}


def test_the_full_yolov2_in_a_pipeline_over_pi_class_devices_is_named_with_its_numbers():
    # at 416 the first of 8 even-FLOPs stages keeps 8 micro-batches of the largest maps
    # (every agent of the 1 GiB testbed was killed running it)
    desc = describe_model("yolov2", 416, classes=5)
    plan = simple_plan("pp", desc, EIGHT, 8, 8)
    short = memory_overflows(plan, desc, {n: GIB for n in EIGHT})
    assert [(o.device, o.stages) for o in short] == [("dev0", [0])]
    assert short[0].need > GIB - RUNTIME_FLOOR
    text = describe(short)
    assert text.startswith("stage 0 needs at least ") and "on dev0, which has 1 GiB" in text
    assert memory_overflows(plan, desc, {n: 4 * GIB for n in EIGHT}) == []
    assert memory_overflows(plan, desc, {}) == []  # memory unknown: nothing to hold it against


def test_dp_of_the_full_yolov2_names_every_device_once():
    desc = describe_model("yolov2", 416, classes=5)
    plan = simple_plan("dp", desc, EIGHT, 8, 8)
    text = describe(memory_overflows(plan, desc, {n: GIB for n in EIGHT}))
    assert text.count("stage 0 needs") == 1 and "each of dev0, dev1" in text and "dev7, which have 1 GiB" in text


@pytest.mark.parametrize("strategy, devices", [("dp", 8), ("pp", 8), ("tiles", 4), ("tiles", 8), ("dp", 1)])
def test_plans_that_ran_on_the_pi_class_testbed_pass(strategy, devices):
    # yolov2-16 at 416, batch 8 in 8 micro-batches, 1 GiB devices: bench/swarm_bench.py ran these
    desc = describe_model("yolov2-16", 416, classes=5)
    names = EIGHT[:devices]
    plan = simple_plan(strategy, desc, names, 8, 8, facts=_pi(names))
    assert memory_overflows(plan, desc, {n: GIB for n in names}) == []


def _runner_plan(model: str, strategy: str, names: list[str], memory: int):
    runner = SwarmRunner(SwarmOptions(strategy=strategy), log=lambda *a: None, fallback=None)
    cfg = TrainConfig(model=model, img_size=416, batch_size=8, microbatches=8, classes=5)
    trainer = SimpleNamespace(cfg=cfg, desc=describe_model(model, 416, classes=5))
    devices = {n: SimpleNamespace(cores=1, memory=memory, address="10.0.0.1", port=4750) for n in names}
    return runner._make_plan(trainer, names, devices)


def test_swarm_train_refuses_a_strategy_the_devices_cannot_hold():
    with pytest.raises(SwarmError, match=r"does not fit in the devices' memory: stage 0 needs at least .* on dev0"):
        _runner_plan("yolov2", "pp", EIGHT, GIB)
    assert _runner_plan("yolov2", "pp", EIGHT, 4 * GIB).stages[0].devices == ["dev0"]
    assert _runner_plan("yolov2-16", "dp", EIGHT, GIB).stages[0].replica_count() == 8


def test_a_re_plan_never_hands_layers_to_devices_that_cannot_hold_them():
    desc = describe_model("yolov2-16", 416, classes=5)
    names = EIGHT[:4]
    roomy = simple_plan("pp", desc, names, 8, 8, facts=_pi(names, 8 * GIB))
    roomy.backups = backup_holders(roomy)
    assert replan(roomy, desc, {"dev1"}, ["dev0", "dev2", "dev3"], "pp").plan.used_devices()
    # each device just holds its own stage: neither shifting dev1's layers to its
    # neighbours nor a fresh pipeline over three fits, so the run must stop rather than
    # lose the survivors one after another
    need = {o.device: o.need for o in memory_overflows(roomy, desc, {n: 1 for n in names})}
    tight = simple_plan("pp", desc, names, 8, 8, facts={n: {"memory": need[n] + RUNTIME_FLOOR + 2**20} for n in names})
    tight.backups = backup_holders(tight)
    assert memory_overflows(tight, desc, {n: f["memory"] for n, f in tight.devices.items()}) == []
    for prefer in ("auto", "light", "heavy"):
        with pytest.raises(PlanError, match="no plan over the devices left fits their memory"):
            replan(tight, desc, {"dev1"}, ["dev0", "dev2", "dev3"], "pp", prefer=prefer)
