"""A short chaos run on the namespace testbed (bench/chaos.py --quick): three seeded faults —
the coordinator's device killed among them, one during the recovery another brings — over a
detached pipeline run, which must end with the weights of the same training on one machine.
(The 6-fault runs over every plan kind take 3-14 minutes each: bench/RESULTS.md has them.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import conftest  # (its helpers named test* would be collected as tests if imported by name)
from tests.conftest import ROOT

pytestmark = [pytest.mark.testbed, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the namespace testbed needs root")]


def test_a_short_chaos_run_ends_equal_to_local_training():
    from swarm.errors import SwarmError
    from swarm.testbed import testbed

    conftest.clear_stale_testbed()
    try:
        in_use = testbed.load() is not None
    except SwarmError as exc:
        conftest.testbed_unavailable(f"a namespace testbed's processes are alive and its record is unreadable: {exc}")
    if in_use or conftest.testbed_left_over():
        conftest.testbed_unavailable(f"a namespace testbed is in use on this machine "
                                     f"(processes {conftest.testbed_processes()})")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--seed", "1", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert re.search(r"^== PASS seed 1: done, 3 of 3 faults, \d+ recover", run.stdout, re.M), tail
    assert "kill-coordinator" in run.stdout and "equal at 1e-07" in run.stdout, tail
