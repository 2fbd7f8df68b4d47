"""Chaos runs (bench/chaos.py): the seeded schedule of faults, and one short chaos run on the
namespace testbed (root) that must end with the weights of local training (float64, 1e-7)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import MACHINE_WIDE, ROOT


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


class KnownChaosFailure(Exception):
    """A chaos run failed the way the runtime fails today (bench/chaos.py's report: a take-over
    that counts a restarted agent as holding its old layers, a coordinator that gives up as cut
    off while other devices answer, holders that elect no successor)."""


KNOWN = ("the state to start from lacks", "cut off from every other device of the plan", "no term done")


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.skipif(os.geteuid() != 0, reason="the namespace testbed needs root")
@pytest.mark.xfail(raises=KnownChaosFailure, strict=False, reason="issue 57: overlapping faults still end some runs")
def test_a_short_chaos_run_ends_equal_to_local_training(tmp_path):
    """3 faults (one kill of the coordinator's device, one during a recovery) on 5 devices of
    0.3 core training a pipeline at 32 px (`bench/chaos.py --quick`): about a minute."""
    # it brings its own testbed up: nothing else may use the machine's meanwhile
    assert "test_chaos" in MACHINE_WIDE, "tests/conftest.py: add test_chaos to MACHINE_WIDE"
    out = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick", "--seed", "5", "--profiles",
                        "none", "--lost-after", "40", "--json", str(out)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.exists(), r.stdout + r.stderr
    summary = json.loads(out.read_text())
    fired = [f for f in summary["faults"] if f["fired_at"] is not None]
    said = r.stdout + "".join(str(t["exit"]) + "\n".join(t["log"]) for t in summary["terms"])
    if r.returncode == 1 and any(k in said for k in KNOWN):
        raise KnownChaosFailure(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert len(fired) == 3 and summary["difference"] <= 1e-7, r.stdout[-8000:]
    assert any(f["during"].startswith(("recovery", "replaying")) for f in fired), r.stdout[-8000:]
    assert any(f["kind"] == "kill-coordinator" for f in fired) and summary["recoveries"], r.stdout[-8000:]
