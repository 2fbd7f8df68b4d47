"""Devices die mid-training and the run ends with the failure-free weights (in process).

Each case kills devices at chosen steps (the kill lands while the next step is running),
the coordinator rolls every stage back to the last complete backup, re-plans over the
survivors and replays; the final weights must equal the local trainer's (float64, so the
comparison tests the logic: see test_execution.py).
"""
from __future__ import annotations

import pytest
import torch

from planner.backups import backup_holders
from planner.baselines import simple_plan
from planner.plan import Plan, Stage
from planner.replan import lightweight, replan
from swarm.data import open_datasets, training_batch
from swarm.execution.inprocess import train_plan_in_process
from swarm.local.trainer import LocalTrainer, TrainConfig
from swarm.zoo import describe_model

STEPS = 5
DEVICES = ["d0", "d1", "d2", "d3"]


def _cfg() -> TrainConfig:
    return TrainConfig(model="yolov2-16", img_size=64, batch_size=8, microbatches=4, seed=11, classes=5,
                       dtype="float64")


@pytest.fixture(scope="module")
def local_weights():
    cfg = _cfg()
    trainer = LocalTrainer(cfg)
    data, _ = open_datasets(None, 64, 3)
    for s in range(STEPS):
        trainer.step(*training_batch(trainer, data, s))
    return trainer.net.state_dict()


def _run(strategy: str, events, backup_interval: int = 1, devices=None, together=None, replicas=None):
    cfg = _cfg()
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, 64, 3)
    plan = simple_plan(strategy, trainer.desc, DEVICES, 8, 4, together=together, replicas=replicas)
    plan.backups = backup_holders(plan)
    coordinator = train_plan_in_process(plan, trainer, data, STEPS, events=events, strategy=strategy,
                                        backup_interval=backup_interval, devices=devices, timeout_s=60)
    return trainer, coordinator


def _worst(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        if a[k].is_floating_point():
            worst = max(worst, float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)))
        else:
            assert torch.equal(a[k], b[k]), k
    return worst


CASES = [
    ("pp", [(1, "kill", "d1", 0.0)], "a single-device pipeline stage"),
    ("pp", [(2, "kill", "d2", 0.05)], "the backup holder of stage 1"),
    ("dp", [(1, "kill", "d1", 0.0)], "a dp replica"),  # a micro-batch of two samples on each of d0-d3
    ("tiles", [(2, "kill", "d2", 0.0)], "a tiles device"),
    ("hybrid", [(1, "kill", "d3", 0.0)], "the last device of a dp stage's group... and the single stage's holder"),
    ("pp", [(1, "kill", "d1", 0.0), (3, "kill", "d3", 0.0)], "two devices, one after the other"),
]


@pytest.mark.parametrize("strategy,events,what", CASES, ids=[c[2].split(" ")[1] + "-" + c[0] for c in CASES])
def test_killed_device_replayed_to_the_failure_free_weights(local_weights, strategy, events, what):
    trainer, coordinator = _run(strategy, events)
    assert trainer.step_count == STEPS
    assert len(coordinator.recoveries) == len(events)
    lost = sorted(d for r in coordinator.recoveries for d in r.lost)
    assert lost == sorted(e[2] for e in events)
    assert all(d not in coordinator.plan.used_devices() for d in lost)
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_backups_every_other_step_roll_back_further(local_weights):
    trainer, coordinator = _run("pp", [(3, "kill", "d2", 0.0)], backup_interval=2)
    (recovery,) = coordinator.recoveries
    assert recovery.rolled_back_to in (2, 3)  # the newest complete backup: step 2 (or the start of a new epoch)
    assert recovery.rolled_back_to == 2
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


@pytest.mark.parametrize("strategy", ["dp", "pp"])
def test_a_device_lost_while_steps_run_over_the_sums_before_them(local_weights, strategy):
    """Between backups each step starts while the step before's sums and updates are still
    under way (worker.Tail); a device killed there leaves the survivors mid-update. They roll
    back to the last backup (which waited for them) and end with the failure-free weights."""
    trainer, coordinator = _run(strategy, [(4, "kill", "d1", 0.0)], backup_interval=3)
    (recovery,) = coordinator.recoveries
    assert recovery.rolled_back_to == 3
    assert trainer.step_count == STEPS
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_a_device_that_is_only_silent_is_waited_for_before_the_run_is_given_up(local_weights):
    """One device is killed while every other has gone quiet (heartbeats lapsing on a busy
    machine: not alive, never reported lost). The coordinator gives the quiet ones a few
    seconds before it decides it has lost the whole plan; d3 answers after one, and the run
    carries on over it to the failure-free weights (without the wait: "lost every device")."""
    silent = [(1, "silence", d, 0.0) for d in ("d0", "d2", "d3")]
    trainer, coordinator = _run("dp", [*silent, (1, "kill", "d1", 0.05), (1, "hear", "d3", 1.0)])
    (recovery,) = coordinator.recoveries
    assert recovery.lost == ["d0", "d1", "d2"]
    assert coordinator.plan.used_devices() == ["d3"]
    assert trainer.step_count == STEPS
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_backups_of_the_same_size_leave_the_heap_alone(monkeypatch):
    """A device gives its heap's free pages back after a backup only when the older backup
    it dropped was larger than the newer (a re-plan left it fewer layers): giving back also
    returns the activations' pages, which the next step would fault in again. Here d3 comes
    back and takes layers from the others."""
    from swarm.execution import replay

    calls = []
    monkeypatch.setattr(replay.malloc, "give_back", lambda: calls.append(1))
    _run("pp", [])
    assert calls == []
    _run("pp", [(1, "kill", "d3", 0.0), (2, "revive", "d3", 0.0)])
    assert calls


def test_device_that_comes_back_is_taken_in(local_weights):
    trainer, coordinator = _run("pp", [(1, "kill", "d3", 0.0), (2, "revive", "d3", 0.0)])
    kinds = [r.how for r in coordinator.recoveries]
    assert kinds[0] in ("lightweight", "heavy") and kinds[-1] == "rejoin"
    assert "d3" in coordinator.plan.used_devices()
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_tiles_running_microbatches_together_lose_a_device(local_weights):
    trainer, coordinator = _run("tiles", [(2, "kill", "d2", 0.0)], together=4)
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9
    assert len(coordinator.recoveries) == 1
    assert coordinator.plan.stages[0].together == 2  # 3 devices of 4 take larger tiles: blocks of 4 -> 2


def test_lightweight_shifts_boundaries_by_flops():
    desc = describe_model("yolov2-16", 128, classes=5)
    plan = simple_plan("pp", desc, DEVICES, 16, 4)
    plan.backups = backup_holders(plan)
    assert plan.backups == {0: "d1", 1: "d2", 2: "d3", 3: "d0"}
    light = lightweight(plan, desc, {"d1"})
    assert [s.devices for s in light.stages] == [["d0"], ["d2"], ["d3"]]
    assert light.stages[0].first == 0 and light.stages[-1].last == 17
    # stage 1's layers are split between its neighbours: both grow
    assert light.stages[0].last > plan.stages[0].last and light.stages[1].first < plan.stages[2].first
    change = replan(plan, desc, {"d1"}, ["d0", "d2", "d3"], "pp")
    assert change.how in ("lightweight", "heavy") and change.why


def test_whole_group_lost_gives_its_layers_to_a_neighbour():
    desc = describe_model("yolov2-16", 128, classes=5)
    plan = Plan("yolov2-16", 128, 16, 4, [Stage(0, 6, "single", ["a"]),
                                          Stage(6, 12, "dp", ["b", "c"], allocation={"b": 2, "c": 2}),
                                          Stage(12, 17, "single", ["d"])])
    light = lightweight(plan, desc, {"b", "c"})
    assert [(s.first, s.last, s.devices) for s in light.stages][0][2] == ["a"]
    assert len(light.stages) == 2 and light.stages[0].last == light.stages[1].first


def test_losing_every_device_stops_with_a_message():
    from swarm.errors import SwarmError

    with pytest.raises(SwarmError, match="lost every device of the plan"):
        _run("pp", [(1, "kill", d, 0.0) for d in DEVICES])


def test_backups_by_time_roll_back_to_the_last_one_complete(local_weights, monkeypatch):
    """backup_interval 0: a backup starts only once the last one is complete and its quiet
    period is over. With a share so small that the quiet period outlasts the run, the only
    backup is the one at the start, and a kill rolls the run back there."""
    import swarm.execution.replay as replay_module

    monkeypatch.setattr(replay_module, "BACKUP_SHARE", 1e-9)
    trainer, coordinator = _run("pp", [(3, "kill", "d2", 0.0)], backup_interval=0)
    (recovery,) = coordinator.recoveries
    assert recovery.rolled_back_to == 0
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_backups_by_time_recover_exactly(local_weights):
    trainer, coordinator = _run("pp", [(2, "kill", "d1", 0.0)], backup_interval=0)
    assert len(coordinator.recoveries) == 1
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


@pytest.mark.parametrize("limit", [1, 7, 64, 1 << 20])
def test_states_cut_into_pieces_come_back_whole(limit):
    from swarm.execution.replay import cut_states, join_states

    torch.manual_seed(0)
    states = {"layers.0.conv.weight": torch.randn(16, 3, 3, 3, dtype=torch.float64),
              "layers.0.bn.num_batches_tracked": torch.tensor(5),
              "layers.1.conv.weight|momentum_buffer": torch.randn(40, 16),
              "layers.2.empty": torch.zeros(0)}
    pieces = cut_states(states, limit)
    sizes = [sum(c[3].numel() * c[3].element_size() for c in p) for p in pieces]
    assert max(sizes) <= max(limit, 8) + 8  # a piece overshoots by less than one element
    if limit < 100:
        assert len(pieces) > 1
    back = join_states(list(reversed(pieces)))
    assert back.keys() == states.keys()
    for k, v in states.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k


def test_a_dp_group_sharing_each_micro_batch_loses_a_device(local_weights):
    trainer, coordinator = _run("dp", [(1, "kill", "d1", 0.0)], replicas=1)
    assert set(coordinator.recoveries[0].lost) == {"d1"}
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_replicated_tiles_lose_a_device(local_weights):
    trainer, coordinator = _run("tiles", [(2, "kill", "d2", 0.0)], replicas=2)
    assert "d2" not in coordinator.plan.used_devices()
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_replicas_with_uneven_shares_lose_one(local_weights):
    """Shifted (--recovery light), d1's share goes to the survivor that grows least for what it
    kept up with: d0, which ran two micro-batches to d2's one, takes it; the run replays to the
    failure-free weights."""
    from planner.plan import Plan, Stage

    cfg = _cfg()
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, 64, 3)
    n = len(trainer.desc.layers)
    plan = Plan("yolov2-16", 64, 8, 4, [Stage(0, n, "single", ["d0", "d1", "d2"], replicas=3, shares=[2, 1, 1])],
                devices={d: {} for d in DEVICES})
    plan.backups = backup_holders(plan)
    coordinator = train_plan_in_process(plan, trainer, data, STEPS, events=[(1, "kill", "d1", 0.0)], strategy="dp",
                                        backup_interval=1, timeout_s=60, recovery="light")
    stage = coordinator.plan.stages[0]
    assert (stage.devices, stage.shares) == (["d0", "d2"], [3, 1])
    assert coordinator.recoveries[0].how == "lightweight"
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


@pytest.mark.parametrize("dead,devices,allocation,groups,shares", [
    # a group that keeps a device: its micro-batches stay with it, split among what is left
    ("d1", ["d0", "d2", "d3"], {"d0": 2, "d2": 2, "d3": 2}, [1, 1, 1], [2, 1, 1]),
    # a group that loses its only device: its micro-batch goes to the group that kept up best
    ("d3", ["d0", "d1", "d2"], {"d0": 2, "d1": 1, "d2": 1}, [1, 2], [3, 1]),
])
def test_replicas_of_dp_groups_lose_one(local_weights, dead, devices, allocation, groups, shares):
    """Replicas that are dp groups (d0 alone | d1 and d2 | d3 alone, taking 2, 1 and 1
    micro-batches), shifted over the survivors, replay to the failure-free weights."""
    cfg = _cfg()
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, 64, 3)
    n = len(trainer.desc.layers)
    plan = Plan("yolov2-16", 64, 8, 4, [Stage(0, n, "dp", ["d0", "d1", "d2", "d3"],
                                              allocation={"d0": 2, "d1": 1, "d2": 1, "d3": 2}, replicas=3,
                                              groups=[1, 2, 1], shares=[2, 1, 1])],
                devices={d: {} for d in DEVICES})
    plan.backups = backup_holders(plan)
    coordinator = train_plan_in_process(plan, trainer, data, STEPS, events=[(1, "kill", dead, 0.0)], strategy="dp",
                                        backup_interval=1, timeout_s=60, recovery="light")
    stage = coordinator.plan.stages[0]
    assert (stage.devices, stage.allocation, stage.groups, stage.replica_shares(4)) == (devices, allocation,
                                                                                         groups, shares)
    assert coordinator.recoveries[0].how == "lightweight"
    assert _worst(trainer.net.state_dict(), local_weights) < 1e-9


def test_a_replicated_stage_in_turns_that_keeps_one_replica_deals_no_more():
    """Replicas that took the micro-batches in turn, one of two lost: the survivor takes them
    all, a plain single stage the plan can run (the lightweight re-plan, no heavy one)."""
    from planner.plan import Plan, Stage
    from planner.replan import lightweight
    from swarm.zoo import describe_model

    desc = describe_model("yolov2-16", 64, classes=5)
    plan = Plan("yolov2-16", 64, 8, 4, [Stage(0, 8, "single", ["a", "b"], replicas=2, deal="turns"),
                                        Stage(8, 17, "single", ["c"])])
    shifted = lightweight(plan, desc, {"b"})
    shifted.validate(desc)
    assert shifted.stages[0].devices == ["a"] and shifted.stages[0].replica_count() == 1
    assert shifted.stages[0].deal is None
