"""A device lost while the run recovers from another: no wait without a watch (in process).

The first loss starts a recovery; a second device is lost in one of its phases, which
the in-process harness reaches through the coordinator's phase_hook (train_plan_in_process
events named by phase, coordinator.RECOVERY_PHASES):

    roll-back   the survivors are decided (and the backup they go back to), not yet re-planned
    re-plan     while the re-plan's thread runs: the plan it returns counts on the lost device
    migration   the new epoch's devices are started and gather their layers; the one lost is
                the one the others take the first loss's layers from
    replay      a replayed step committed, more are to be replayed

Each loss must end what waits on the device at once and start the next recovery over the
survivors, and the run must end with the failure-free weights (float64, < 1e-9, as in
test_replay.py). A "vanish"ed device dies with no loss reported (the news went astray, as
on the testbed where the coordinator waited 600 s for a device killed before its re-plan):
the coordinator's watch also looks at what the control knows dead. Where no device is left,
the run ends with one line. The job's timeout is short, so a wait that is not watched fails
the test instead of outwaiting it.
"""
from __future__ import annotations

import math
import re
import sys
from types import SimpleNamespace

import pytest
import trio

from planner.backups import backup_holders
from planner.baselines import simple_plan
from planner.plan import Plan, Stage
from swarm.data import open_datasets, training_batch
from swarm.errors import SwarmError
from swarm.execution.inprocess import LocalControl, train_plan_in_process
from swarm.local.trainer import LocalTrainer, TrainConfig
from tests.test_replay import _worst

STEPS = 4
DEVICES = ["d0", "d1", "d2", "d3"]
TIMEOUT_S = 20  # the longest any message may take: far above what a watched run needs here


def _cfg() -> TrainConfig:
    return TrainConfig(model="yolov2-16", img_size=32, batch_size=4, microbatches=2, seed=11, classes=5,
                       dtype="float64")


@pytest.fixture(scope="module")
def local_weights():
    trainer = LocalTrainer(_cfg())
    data, _ = open_datasets(None, 32, 3)
    for s in range(STEPS):
        trainer.step(*training_batch(trainer, data, s))
    return trainer.net.state_dict()


def _run(events, plan=None, backup_interval: int = 1, timeout_s: float = TIMEOUT_S):
    trainer = LocalTrainer(_cfg())
    data, _ = open_datasets(None, 32, 3)
    plan = plan or simple_plan("pp", trainer.desc, DEVICES, 4, 2)
    plan.backups = backup_holders(plan)
    coordinator = train_plan_in_process(plan, trainer, data, STEPS, events=events, backup_interval=backup_interval,
                                        timeout_s=timeout_s)
    return trainer, coordinator


def _check_equal_to_local(trainer, coordinator, local_weights, lost: set[str]) -> None:
    assert trainer.step_count == STEPS
    assert {d for r in coordinator.recoveries for d in r.lost} == lost
    assert not lost & set(coordinator.plan.used_devices())
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


# (phase, first loss, second, backup interval, recoveries that started their plan)
PHASES = [
    # the survivors and the backup step are decided: the one recovery that re-plans leaves out both
    ("roll-back", (1, "kill", "d1", 0.0), "d2", 1, 1),
    # the plan made counts on d2: it is never started, the next re-plan leaves out both
    ("re-plan", (1, "kill", "d1", 0.0), "d2", 1, 1),
    # d2 holds the backup of d1's layers, which d0 and d3 wait for: they come from the start instead
    ("migration", (1, "kill", "d1", 0.0), "d2", 1, 2),
    # backups every 3 steps: the first loss rolls back to step 0 and replays two steps
    ("replay", (2, "kill", "d1", 0.0), "d3", 3, 2),
]


@pytest.mark.parametrize("phase,first,second,backup_interval,recoveries", PHASES, ids=[p[0] for p in PHASES])
def test_a_device_lost_in_each_phase_of_a_recovery_starts_the_next(local_weights, phase, first, second,
                                                                      backup_interval, recoveries):
    trainer, coordinator = _run([first, (phase, "kill", second, 0.0)], backup_interval=backup_interval)
    _check_equal_to_local(trainer, coordinator, local_weights, {first[2], second})
    assert len(coordinator.recoveries) == recoveries
    assert coordinator.recoveries[-1].lost == sorted({first[2], second} if recoveries == 1 else {second})
    assert coordinator.control.epochs_started == 1 + recoveries


@pytest.mark.parametrize("phase,first,second,backup_interval", [p[:4] for p in PHASES if p[0] in
                                                                  ("migration", "replay")], ids=["migration", "replay"])
def test_a_loss_whose_news_went_astray_still_ends_the_waits_on_it(local_weights, phase, first, second,
                                                                   backup_interval):
    """No loss is reported for `second` (as on the testbed, where the coordinator waited for a
    step of a device killed before the re-plan): the watch finds it among the devices the
    control knows dead, and the run recovers as from any loss (before: TooSlowError)."""
    trainer, coordinator = _run([first, (phase, "vanish", second, 0.0)], backup_interval=backup_interval)
    _check_equal_to_local(trainer, coordinator, local_weights, {first[2], second})


def test_the_testbed_case_a_dp_stage_and_single_stages_lose_both_dp_devices(local_weights):
    """The plan of the issue: a dp stage over two devices, then single stages. One dp device
    goes quietly, the other is reported lost while the survivors gather their layers: no
    survivor holds the dp stage's layers, and they come from the coordinator's own copy."""
    plan = Plan("yolov2-16", 32, 4, 2, [Stage(0, 6, "dp", ["d0", "d1"], allocation={"d0": 1, "d1": 1}),
                                        Stage(6, 12, "single", ["d2"]), Stage(12, 17, "single", ["d3"])])
    trainer, coordinator = _run([(2, "vanish", "d1", 0.0), ("migration", "kill", "d0", 0.0)], plan=plan)
    _check_equal_to_local(trainer, coordinator, local_weights, {"d0", "d1"})
    assert coordinator.recoveries[-1].rolled_back_to == 0


def test_losses_that_leave_no_device_end_the_run_in_one_line():
    trainer = LocalTrainer(_cfg())
    data, _ = open_datasets(None, 32, 3)
    plan = simple_plan("pp", trainer.desc, ["d0", "d1"], 4, 2)
    plan.backups = backup_holders(plan)
    with pytest.raises(SwarmError) as caught:
        train_plan_in_process(plan, trainer, data, STEPS, events=[(1, "kill", "d1", 0.0),
                                                                  ("migration", "kill", "d0", 0.0)],
                              timeout_s=TIMEOUT_S)
    assert type(caught.value) is SwarmError  # itself, not an exception group
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("lost every device of the plan (d0)") and "training stopped after step 1" in message


def test_a_device_that_hangs_alive_ends_the_run_in_one_line(monkeypatch):
    """A device whose part stops without the device being lost (it still counts as alive) is
    waited for up to the job's timeout; then the run ends in one line, not a traceback."""
    monkeypatch.setattr(LocalControl, "hang", lambda control, d: control.scopes.pop(d).cancel(), raising=False)
    with pytest.raises(SwarmError) as caught:  # (a timeout of 2 s ran out in step 1, before the hang, in a loaded CI)
        _run([(1, "hang", "d2", 0.0)], timeout_s=8)
    assert type(caught.value) is SwarmError
    # the first device waited for names it (d0, whose step waits on d2's part through d1)
    assert re.fullmatch(r"d[0-3] sent no ready for step 2 within 8 s, yet still counts as alive; training stopped "
                        r"after step 1", str(caught.value))


def test_a_run_that_gives_up_names_its_checkpoint(tmp_path):
    from swarm.execution.coordinator import TrainingCoordinator
    from swarm.execution.worker import JobSpec

    trainer = LocalTrainer(_cfg())
    plan = simple_plan("pp", trainer.desc, DEVICES, 4, 2)
    coordinator = TrainingCoordinator(None, JobSpec(plan, trainer.cfg, None), trainer, None)
    coordinator.furthest, coordinator.own_step = 7, 5
    assert str(coordinator.give_up("lost every device of the plan (d0)")) == \
        "lost every device of the plan (d0); training stopped after step 7"
    path = tmp_path / "run.pt"
    path.write_bytes(b"")
    coordinator.checkpoint_path = str(path)
    assert str(coordinator.give_up("lost d0")) == (f"lost d0; training stopped after step 7; its checkpoint (step 5) "
                                                   f"is {path}: `swarm train --resume {path}` carries it on")


def test_the_roster_keeps_the_loss_of_a_device_that_died_between_epochs():
    """RosterControl drops a loss that concerned an older epoch only (a broken link whose
    device answers again); one of a device that does not answer now is still news, and a
    device the swarm knows dead is gone() whatever was reported."""
    from swarm.execution.launch import RosterControl

    health = {"n3": "alive", "n4": "dead"}
    cluster = SimpleNamespace(
        subscribe=lambda: trio.open_memory_channel(math.inf)[1],
        device=lambda node: SimpleNamespace(health=health[node], conn=SimpleNamespace(closed=health[node] != "alive")))
    names = {"dev3": SimpleNamespace(node_id="n3"), "dev4": SimpleNamespace(node_id="n4")}

    async def main():
        async with trio.open_nursery() as nursery:
            control = RosterControl(cluster, "job", names, nursery, log=lambda s: None)
            control.epoch = 1
            control._lose({"dev3"}, 0)  # a link broke in epoch 0, and dev3 answers: news no longer
            control._lose({"dev4"}, 0)  # dev4 died in epoch 0, reported once the coordinator was in 1
            with trio.fail_after(1):
                assert await control.next_loss() == {"dev4"}
            assert control.gone() == {"dev4"}
            nursery.cancel_scope.cancel()

    trio.run(main)


class Followed:
    """A quorum.Lease whose devices all answer every ask, until `cut` leaves only `kept` answering;
    its stop comes `late` seconds after the lease's own (so that the commits alone show whether
    they wait for the lease). `granted`: when each ask that let a step commit was made."""

    def __init__(self, lease, kept: set[str], late: float):
        self.lease, self.kept, self.cut_at, self.late = lease, kept, None, late
        self.granted: list[float] = []

    def cut(self) -> None:
        self.cut_at = trio.current_time()

    def _asked(self, now: float) -> None:
        for d in self.lease.devices if self.cut_at is None else self.kept:
            self.lease.heard_from(d, now)

    def may_commit(self, now: float) -> bool:
        self._asked(now)
        if self.lease.may_commit(now):
            self.granted.append(now)
            return True
        return False

    def must_stop(self, now: float) -> bool:
        self._asked(now)
        return self.lease.must_stop(now - self.late)

    def why(self, now: float, step: int) -> str:
        return self.lease.why(now, step)


def test_a_coordinator_that_loses_its_majority_commits_nothing_after_its_lease_and_stops_in_one_line():
    """The coordinator (its own device "c") and d0 keep hearing each other; d1, d2 and d3 are cut
    off after step 2: 2 of 5 devices. No step commits once the lease has run out, and the run
    ends with the lease's one line."""
    from swarm.agent.quorum import Lease

    lease_s = 0.6
    followed = Followed(Lease(set(DEVICES) | {"c"}, "c", 0, lease_s, 0.0), {"d0"}, late=2.0)
    committed = []

    def stepped(report):
        committed.append((report.step, trio.current_time()))
        if report.step == 2:
            followed.cut()
    trainer = LocalTrainer(_cfg())
    data, _ = open_datasets(None, 32, 3)
    plan = simple_plan("pp", trainer.desc, DEVICES, 4, 2)
    plan.backups = backup_holders(plan)
    followed.lease.began = -math.inf  # (trio's clock starts anywhere)
    with pytest.raises(SwarmError) as stopped:
        train_plan_in_process(plan, trainer, data, 50, lease=followed, on_step=stepped, timeout_s=TIMEOUT_S)
    assert f"heard from 2 of 5 devices (a majority is 3) in the last {lease_s:.1f} s" in str(stopped.value)
    assert "\n" not in str(stopped.value)
    assert [s for s, _ in committed][:2] == [1, 2] and len(committed) < 50
    # each commit was let through by an ask made before the lease ran out (the commit itself,
    # its messages and backup acks, may end a little later on a loaded machine)
    assert len(followed.granted) == len(committed), (followed.granted, committed)
    assert all(at < followed.cut_at + lease_s for at in followed.granted), (followed.granted, followed.cut_at)


def test_a_device_whose_memory_another_program_takes_is_planned_around_at_the_next_backup(local_weights):
    """After step 1, d2 can spare 1 MiB (another program took its memory): at the next backup
    step the run moves to a plan without it, before the kernel would kill it, and ends with the
    failure-free weights."""
    trainer = LocalTrainer(_cfg())
    data, _ = open_datasets(None, 32, 3)
    plan = simple_plan("pp", trainer.desc, DEVICES, 4, 2)
    plan.backups = backup_holders(plan)
    plan.devices = {d: {"memory": 2**31} for d in DEVICES}  # what each could spare when planned
    lines = []
    coordinator = train_plan_in_process(plan, trainer, data, STEPS, events=[(1, "squeeze", "d2", 0.0)],
                                        timeout_s=TIMEOUT_S, log=lines.append)
    assert [(r.how, r.lost) for r in coordinator.recoveries] == [("memory", ["d2"])], lines
    assert any(re.match(r"d2 can spare 1 MiB, under the \d+ MiB its part needs: re-planned around it from step 2",
                        line) for line in lines), lines
    assert "d2" not in coordinator.plan.used_devices()
    assert trainer.step_count == STEPS and _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_layers_come_only_from_devices_of_the_new_plan():
    """A device left out of the next plan has no part in its epoch: a move from it would never
    come (a re-costed or shrunk plan hung on one for the job's timeout). The backup's layers
    come from the plan's own devices, or, where none of them has a layer, from the
    coordinator's copy."""
    from swarm.execution.replay import BackupLedger

    desc = LocalTrainer(_cfg()).desc
    ledger = BackupLedger(1)
    layers = len(desc.layers)
    ledger.step, ledger.holdings = 4, {"d0": set(range(8)), "d1": set(range(8, layers)), "d2": set(range(layers))}
    plan = simple_plan("pp", desc, ["d0", "d1"], 4, 2)
    moves, step = ledger.sources(plan, 2, layers)
    assert step == 4 and {m.src for m in moves} <= {"d0", "d1"}, moves  # d2 has everything, but is not in the plan
    plan = simple_plan("pp", desc, ["d0", "d3"], 4, 2)  # d3 new; only d1 and d2 held layers 8 and up
    moves, step = ledger.sources(plan, 2, layers)
    assert step == 2 and {m.src for m in moves} == {"coordinator"}, moves


def test_an_epoch_started_before_the_newest_backup_forgets_it():
    """Rolled back past the newest backup (to the coordinator's copy), the devices drop what
    is newer than the start: the ledger (and so the replica a successor takes over from) no
    longer names that backup or its holdings."""
    from swarm.execution.replay import BackupLedger

    ledger = BackupLedger(1)
    ledger.step, ledger.holdings = 18, {"d0": {0, 1}, "d1": {2, 3}}
    ledger.epoch_started(18, ["d0", "d1"])  # from the backup itself: kept
    assert (ledger.step, ledger.holdings) == (18, {"d0": {0, 1}, "d1": {2, 3}})
    ledger.epoch_started(0, ["d0", "d1"])
    assert (ledger.step, ledger.holdings) == (None, {})


def test_a_device_that_lacks_a_holding_it_is_counted_for_is_a_lost_holding_and_the_run_recovers_again(local_weights):
    """After step 1 d1 loses what it kept (an agent started again, its layers gone) while the
    run goes on; then d2 dies. The recovery counts on d1's snapshot of its own stage; d1 lacks
    it, which makes d1 a lost device too (not the end of the run), and the next recovery goes
    on without what d1 kept, to the failure-free weights."""
    trainer, coordinator = _run([(1, "forget", "d1", 0.0), (1, "kill", "d2", 0.05)])
    lost = [set(r.lost) for r in coordinator.recoveries]
    assert lost[0] == {"d2"} and {"d1"} in lost[1:], lost
    assert trainer.step_count == STEPS and _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_a_missing_holding_names_its_holder_in_the_text_the_roster_reads():
    from planner.backups import Move
    from swarm.execution.replay import MISSING_HOLDING, holding_missed, missing_holding

    moves = [Move("d3", "d0", 1, [5, 6], 2), Move("d1", "d0", 1, [7, 8, 9], 2), Move("d1", "d2", 1, [9], 2)]
    lacking = missing_holding(moves, "d0", 1, {8, 9, 12})
    assert lacking is not None and lacking.holder == "d1"
    assert str(lacking) == "d1 lacks layers [8, 9] of stage 1 at step 2, which it was counted as holding"
    assert missing_holding(moves, "d0", 1, {12}) is None  # nobody was to bring it
    wrapped = f"job train-1 on d0 failed: ExceptionGroup: ... ({lacking})"
    assert MISSING_HOLDING.search(wrapped).group(1) == "d1"
    if sys.version_info < (3, 11):
        from exceptiongroup import BaseExceptionGroup as Group  # (trio's, before Python 3.11)
    else:
        Group = BaseExceptionGroup
    assert holding_missed(Group("tasks", [ValueError("x"), Group("in", [lacking])])) is lacking
