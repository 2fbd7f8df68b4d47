"""Chaos runs (bench/chaos.py): the seeded schedule of faults, and how an agent's RSS is
compared between recoveries. (The runs themselves take 3-14 minutes each on the testbed,
more than the suite has: bench/RESULTS.md has them, and docs/runtime.md, "Chaos runs", what
they found.)"""
from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


chaos = load_chaos()


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("faults,steps", [(1, 15), (3, 25), (6, 40)])
def test_a_schedule_has_a_coordinator_kill_and_a_fault_during_a_recovery(seed, faults, steps):
    plan = chaos.schedule(seed, faults, steps)
    assert plan == chaos.schedule(seed, faults, steps)  # the seed says it all
    assert len(plan) == faults and "kill-coordinator" in [f.kind for f in plan]
    during = [i for i, f in enumerate(plan) if f.step is None]
    if faults >= 2:
        assert during and 0 not in during
    for i in during:  # right after a fault that brings a recovery, aimed at one of its moments
        assert plan[i - 1].kind in chaos.DISRUPTIVE and plan[i].phase in chaos.PHASES
    at_steps = [f.step for f in plan if f.step is not None]
    assert at_steps == sorted(at_steps) and all(3 <= s <= steps - 5 for s in at_steps)
    for f in plan:
        low, high = chaos.UNDO_AFTER_S[f.kind]
        assert low <= f.undo_after_s <= high


def test_rss_compares_an_agents_readings_in_one_role_only():
    from planner.plan import Plan, Stage
    from swarm.execution.launch import device_roles

    plan = Plan("yolov2-16", 64, 8, 4, [Stage(0, 8, "single", ["a"]), Stage(8, 12, "dp", ["b", "c"], {"b": 1, "c": 1}),
                                        Stage(12, 17, "single", ["c"])], backups={0: "b", 2: "b"})
    assert device_roles(plan) == {"a": "0-7 single", "b": "backs up 0-7; 8-11 dp 1 of 2 samples; backs up 12-16",
                                  "c": "8-11 dp 1 of 2 samples; 12-16 single"}
    rss = {"a": [(1, 10.0, 300.0, "0-7 single"), (1, 20.0, 420.0, "0-11 single"), (1, 30.0, 315.0, "0-7 single")],
           "b": [(2, 10.0, 300.0, "8-11 dp of 2")]}
    growth = chaos.rss_growth(rss)
    assert growth == {"a/1 (0-7 single)": pytest.approx(0.05)}  # a's 420 was in another role; b read once


def test_a_fault_aimed_at_a_phase_its_recovery_never_had_fires_once_the_run_moves_past_it():
    """A takeover that replays one step has no replayed step with more to come: the fault aimed
    at its replay fires at the first new step after it, not never (the run ending first)."""
    run = object.__new__(chaos.Chaos)  # (no testbed: only what `due` reads)
    run.t0, run.armed_at, run.armed_step, run.furthest, run.phase_seen = 0.0, None, 0, 31, []
    fault = chaos.Fault("kill", None, "replay", 5.0)
    clock = iter([100.0, 101.0, 102.0, 103.0, 104.0, 105.0])
    run.now = lambda: next(clock)
    assert run.due(fault) == (False, "")  # armed at step 31, nothing seen yet
    run.phase_seen.append((101.5, "re-plan"))
    assert run.due(fault) == (False, "")  # the recovery re-planned; its replay may come
    run.furthest = 32
    fire, why = run.due(fault)
    assert fire and "it had none" in why
    run.armed_at, run.phase_seen = 103.5, [(104.0, "replay")]
    assert run.due(fault) == (True, "aimed at the recovery's replay")
