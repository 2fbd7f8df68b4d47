"""Plans re-costed on what the devices measure (planner/recost.py), and the run that switches
to such a plan mid-training ending with the weights of local training."""
from __future__ import annotations

import time

import pytest
import torch

from planner.baselines import simple_plan
from planner.inputs import PlanInputs
from planner.memory import MemoryModel
from planner.planners import make_plan
from planner.plan import Plan
from planner.recost import (MEASURED_SHARE, RECOST_GAIN, RATIO_BOUNDS, SWITCH_STEPS, Recost, corrected, own_compute,
                            recost, speed_ratios)
from planner.synthetic import flops_cluster
from swarm.data import open_datasets, training_batch
from swarm.execution.inprocess import train_plan_in_process
from swarm.local.trainer import LocalTrainer, TrainConfig
from swarm.zoo import describe_model


def _inputs(gflops: dict[str, float], memory: str = "2 GiB", batch: int = 8, micro: int = 2) -> PlanInputs:
    desc = describe_model("yolov2-16", 128)
    cluster = flops_cluster(desc, {d: (g, memory) for d, g in gflops.items()}, mbps=100)
    return PlanInputs(desc, MemoryModel.for_devices(desc), cluster, batch, micro)


def test_own_compute_is_each_devices_samples_by_its_cost_table():
    inputs = _inputs({"a": 4, "b": 4, "c": 8})
    plan = simple_plan("dp", inputs.desc, ["a", "b", "c"], 8, 2)
    n = len(inputs.desc.layers)
    own = own_compute(plan, inputs.cluster)
    for d in ("a", "b", "c"):
        costs = inputs.cluster.device(d).costs
        samples = plan.stages[0].allocation[d]
        per_mb = costs.fwd_range(0, n, samples) + costs.bwd_range(0, n, samples) + sum(costs.loss_time(samples))
        assert own[d] == pytest.approx(2 * per_mb + costs.update_range(0, n))
    assert own["c"] < own["a"]  # as fast as two of them, with no more samples
    pipeline = simple_plan("pp", inputs.desc, ["a", "b"], 8, 2)
    assert set(own_compute(pipeline, inputs.cluster)) == {"a", "b"}
    assert own_compute(simple_plan("tiles", inputs.desc, ["a", "b", "c"], 8, 2), inputs.cluster) is None



def test_a_device_under_a_quota_reports_its_compute_as_its_profile_counts_it(monkeypatch):
    """Under a quota below a core a device's busy time also holds the stalls of its quota
    while the event loop sums gradients, twice its compute at one sample a step (measured on
    the testbed), which the cost model charges apart. Such a device reports the compute
    thread's CPU over the share the planner gives it (its quota: the runtime's own CPU is charged a step at a time);
    elsewhere, and on an accelerator, the busy time less its waits for BatchNorm sums and
    for the step before's updates."""
    from types import SimpleNamespace

    from swarm.execution import worker
    from swarm.local.compute_device import HOST
    monkeypatch.setattr(worker, "cpu_quota", lambda: 0.2)
    share = worker.quota_share(HOST)
    assert share == pytest.approx(0.2)
    assert worker.quota_share(torch.device("meta")) is None  # (an accelerator's compute is timed as it runs)
    monkeypatch.setattr(worker, "cpu_quota", lambda: None)
    assert worker.quota_share(HOST) is None
    monkeypatch.setattr(worker, "cpu_quota", lambda: 2.0)
    assert worker.quota_share(HOST) is None

    step = dict(busy_s=10.0, exchange_s=1.0, gate_s=0.5, compute_cpu_s=0.9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert worker.DeviceWorker.own_s(SimpleNamespace(share=share, **step)) == pytest.approx(0.9 / share)
        assert worker.DeviceWorker.own_s(SimpleNamespace(share=None, **step)) == pytest.approx(8.5)
    finally:
        torch.set_num_threads(threads)


def test_ratios_are_bounded_and_an_unmeasured_device_takes_their_median():
    lo, hi = RATIO_BOUNDS
    ratios = speed_ratios({"a": 1.0, "b": 2.0, "c": 1.0, "d": 0.0}, {"a": 1.5, "b": 100.0, "c": 0.0, "d": 1.0})
    assert ratios == {"a": 1.5, "b": hi}
    inputs = _inputs({"a": 4, "b": 4, "x": 4})
    fixed = corrected(inputs.cluster, {"a": 2.0, "b": 1.0})
    t = {d: inputs.cluster.device(d).costs.fwd_range(0, 5, 1) for d in ("a", "b", "x")}
    assert fixed.device("a").costs.fwd_range(0, 5, 1) == pytest.approx(2.0 * t["a"])
    assert fixed.device("b").costs.fwd_range(0, 5, 1) == pytest.approx(t["b"])
    assert fixed.device("x").costs.fwd_range(0, 5, 1) == pytest.approx(1.5 * t["x"])
    assert lo < 1 < hi


def test_a_device_with_next_to_no_compute_takes_the_others_ratio():
    """A last stage of a pooling layer and a softmax computes a few milliseconds a step, mostly
    each operation's fixed cost: its ratio says nothing of its device's speed."""
    predicted = {"a": 3.0, "b": 3.0, "head": 0.5 * MEASURED_SHARE * 3.0}
    ratios = speed_ratios(predicted, {"a": 3.3, "b": 3.6, "head": 0.25 * predicted["head"]})
    assert set(ratios) == {"a", "b"}
    inputs = _inputs({"a": 4, "b": 4, "head": 4})
    fixed = corrected(inputs.cluster, ratios)
    t = inputs.cluster.device("head").costs.fwd_range(0, 5, 1)
    assert fixed.device("head").costs.fwd_range(0, 5, 1) == pytest.approx(1.15 * t)  # the median of 1.1 and 1.2


def test_a_switch_is_taken_only_where_it_pays_for_itself_over_the_steps_left():
    better = Recost({"a": 1.0}, 10.0, object(), 8.0)  # saves 2 s a step
    needed = SWITCH_STEPS * 8.0 / 2.0  # steps after the switch to save SWITCH_STEPS of the new plan's
    assert not better.pays(int(needed)) and better.pays(int(needed) + 1)
    assert not Recost({"a": 1.0}, 10.0, None, 8.0).pays(1000)  # nothing to switch to


def test_a_device_slower_than_its_profile_gets_less_of_the_work():
    inputs = _inputs({"a": 4, "b": 4, "c": 4, "d": 4})
    plan = make_plan("auto", inputs)
    predicted = own_compute(plan, inputs.cluster)
    slow = plan.used_devices()[-1]
    measured = {d: t * (3.0 if d == slow else 1.0) for d, t in predicted.items()}
    result = recost(plan, inputs, measured, inputs.cluster.names)
    assert result.ratios[slow] == pytest.approx(3.0)
    assert result.plan is not None and result.new_s <= (1 - RECOST_GAIN) * result.current_s
    before = own_compute(plan, inputs.cluster)[slow] / sum(predicted.values())
    after = own_compute(result.plan, inputs.cluster)
    assert after.get(slow, 0.0) / sum(after.values()) < before
    assert "keeping" not in result.describe()


def test_measures_that_match_the_profiles_keep_the_plan():
    inputs = _inputs({"a": 4, "b": 2, "c": 8})
    plan = make_plan("auto", inputs)
    measured = {d: 1.1 * t for d, t in own_compute(plan, inputs.cluster).items()}  # all a little slower
    result = recost(plan, inputs, measured, inputs.cluster.names)
    assert result.plan is None and "keeping it" in result.describe()
    assert result.current_s == pytest.approx(1.1 * plan.predicted["step_time_s"], rel=0.1)
    tiles = simple_plan("tiles", inputs.desc, ["a", "b", "c"], 8, 2)
    assert recost(tiles, inputs, measured, inputs.cluster.names) is None


# ---- a run that switches plans -------------------------------------------------------------
STEPS = 5


def _cfg() -> TrainConfig:
    return TrainConfig(model="yolov2-16", img_size=64, batch_size=8, microbatches=4, seed=11, classes=5,
                       dtype="float64")


class _Switch:
    """A recost that answers `plan` once, and records what it was asked."""

    def __init__(self, plan: Plan, current_s: float = 2.0):
        self.plan, self.asked, self.current_s = plan, [], current_s

    def __call__(self, plan, measured, alive):
        from planner.recost import Recost

        self.asked.append((plan, dict(measured), list(alive)))
        return Recost({d: 1.0 for d in measured}, self.current_s, self.plan, 0.5)


@pytest.mark.parametrize("backup_interval", [1, 0], ids=["backups-every-step", "backups-by-time"])
def test_a_run_that_switches_to_a_re_costed_plan_ends_with_the_local_weights(backup_interval):
    cfg = _cfg()
    data, _ = open_datasets(None, 64, 3)
    local = LocalTrainer(cfg)
    for s in range(STEPS):
        local.step(*training_batch(local, data, s))

    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    first = simple_plan("dp", trainer.desc, ["d0", "d1", "d2", "d3"], 8, 4)
    second = simple_plan("pp", trainer.desc, ["d2", "d0"], 8, 4)
    switch = _Switch(second)
    coordinator = train_plan_in_process(first, trainer, data, STEPS, strategy="dp", timeout_s=60, recost=switch,
                                        devices=["d0", "d1", "d2", "d3"], backup_interval=backup_interval)
    assert len(switch.asked) == 1  # once, after the first epoch's second step; not again for the plan it chose
    asked_plan, measured, alive = switch.asked[0]
    assert asked_plan is first and set(measured) == {"d0", "d1", "d2", "d3"} and all(t > 0 for t in measured.values())
    assert [r.how for r in coordinator.recoveries] == ["recost"]
    # switched at the step it was decided at, when that is a backup step, or at the next one
    assert coordinator.recoveries[0].rolled_back_to == (2 if backup_interval == 1 else 3)
    assert coordinator.plan.used_devices() == ["d2", "d0"]
    assert trainer.step_count == STEPS
    for k, v in local.net.state_dict().items():
        if v.is_floating_point():
            assert float((trainer.net.state_dict()[k] - v).norm() / v.norm().clamp(min=1e-30)) < 1e-10, k
        else:
            assert torch.equal(trainer.net.state_dict()[k], v), k


@pytest.mark.parametrize("backup_interval", [1, 100])
def test_a_re_costed_plan_that_would_not_pay_for_the_switch_is_not_taken(backup_interval):
    """Nor is a backup taken early for it: the copies of every stage would only slow the next
    step (the backup steps of the run's own interval come as they would)."""
    cfg = _cfg()
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, 64, 3)
    first = simple_plan("dp", trainer.desc, ["d0", "d1"], 8, 4)
    switch = _Switch(simple_plan("pp", trainer.desc, ["d1", "d0"], 8, 4), current_s=0.6)  # 0.1 s a step saved
    lines, reports = [], []
    coordinator = train_plan_in_process(first, trainer, data, 4, strategy="dp", timeout_s=60, recost=switch,
                                        devices=["d0", "d1"], backup_interval=backup_interval, log=lines.append,
                                        on_step=reports.append)
    assert len(switch.asked) == 1 and coordinator.recoveries == []
    assert coordinator.plan.used_devices() == ["d0", "d1"] and trainer.step_count == 4
    assert sum("would not pay for the switch" in line for line in lines) == 1, lines
    if backup_interval > 4:
        assert not any(r.backup for r in reports), [(r.step, r.backup) for r in reports]


def test_a_devices_step_says_how_much_of_its_compute_was_in_the_kernel():
    """Where the kernel charges a softirq to the thread it interrupts, the network's work is
    in the compute thread's CPU time; its system time (compute_sys_s) shows how much."""
    import os
    import sys

    from swarm.execution.worker import _thread_sys_s

    if sys.platform.startswith("linux"):
        before = _thread_sys_s()
        with open(os.devnull, "wb") as sink:
            for _ in range(200_000):
                sink.write(b"x")
                sink.flush()  # a system call each
        assert _thread_sys_s() > before
    trainer = LocalTrainer(TrainConfig(**vars(_cfg())))
    data, _ = open_datasets(None, 64, 3)
    reports = []
    train_plan_in_process(simple_plan("dp", trainer.desc, ["d0", "d1"], 8, 4), trainer, data, 2, strategy="dp",
                          timeout_s=60, on_step=reports.append, devices=["d0", "d1"])
    for report in reports:
        for device in ("d0", "d1"):
            times = report.times[device]
            assert 0.0 <= times["compute_sys_s"] <= times["compute_cpu_s"] + 0.01, times


def test_a_steps_time_counts_what_the_coordinator_did_since_the_last_commit():
    """Re-costing runs between two commits while the devices already compute the next step;
    that step's time, and so its samples a second, must count it (it ran from the commit
    before it), or the step after every re-cost reads faster than the run went."""
    trainer = LocalTrainer(TrainConfig(**vars(_cfg())))
    data, _ = open_datasets(None, 64, 3)
    plan = simple_plan("dp", trainer.desc, ["d0", "d1"], 8, 4)
    pause = 1.0

    def slow_recost(plan, measured, alive):
        time.sleep(pause)  # a planner that takes a while, then keeps the plan
        return None

    reports, at = [], []

    def on_step(report):
        reports.append(report)
        at.append(time.monotonic())

    train_plan_in_process(plan, trainer, data, 4, strategy="dp", timeout_s=60, recost=slow_recost, on_step=on_step,
                          devices=["d0", "d1"])
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert reports[2].seconds >= pause  # re-costed after step 2: step 3 ran from step 2's commit
    for k in (1, 2, 3):  # each step's time is the time between its commit and the last one
        assert reports[k].seconds == pytest.approx(at[k] - at[k - 1], abs=0.25)
