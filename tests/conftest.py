"""Test set-up shared by every test: discovery pinned to loopback, small thread counts."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Discovery and connections never leave the machine in tests: every swarm command (and
# every subprocess a test starts) sees this unless a test pins another interface itself.
os.environ["SWARM_INTERFACE"] = "lo"
os.environ["SWARM_CONFIG"] = os.devnull  # never the machine's own /etc/swarm/swarm.toml

# On two workers (below) tests compute beside each other, and an OpenMP team that spins while
# it waits, as libgomp's does by default, takes the core from the test beside it: two
# two-thread trainings side by side each took 11x as long as one alone, and 1.7x with a
# short spin (set before torch is imported; the subprocesses a test starts inherit it).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")


# The suite runs on two processes (pytest -n 2, the README's command). The modules below
# share something machine-wide, so they run one after another on one of them: the namespace
# testbed (one per machine), agents advertising on loopback's mDNS, and checks of how long
# something took or how much memory it reached. Meanwhile the other process runs the rest.
MACHINE_WIDE = {
    "test_agent", "test_agent_bounds", "test_auth", "test_clean_stop", "test_cuda", "test_deploy_notify",
    "test_detached", "test_discovery", "test_failover", "test_flapping", "test_memory_model",
    "test_planner_live", "test_service_install", "test_status", "test_swarm_detached", "test_swarm_replay",
    "test_swarm_training", "test_testbed", "test_torch_libs", "test_wire_sockets",
}


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load scheduling, with every MACHINE_WIDE test in one unit of work."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class MachineWideTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "machine-wide" if _module_of(nodeid) in MACHINE_WIDE else nodeid

    return MachineWideTogether(config, log)


@pytest.fixture(autouse=True)
def _pin_interface(monkeypatch):
    monkeypatch.setenv("SWARM_INTERFACE", os.environ.get("SWARM_TEST_INTERFACE", "lo"))


def run_swarm(*args, cwd=None, env=None, timeout=600):
    """Run the `swarm` command line in a fresh interpreter; returns CompletedProcess."""
    import subprocess

    full_env = dict(os.environ)
    full_env.setdefault("PYTHONPATH", str(ROOT))
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "swarm", *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


class LocalRun:
    """`swarm train --strategy local FLAGS --save PATH`, started now in a thread of its own
    (one such run at a time), for a test to compare its own run with: started first, the
    reference trains beside that run (a testbed run leaves this machine's cores partly idle,
    a one-thread run leaves a core), and .weights() or .checkpoint() waits for it."""

    _pool = None

    def __init__(self, path, *flags, timeout=900):
        from concurrent.futures import ThreadPoolExecutor

        if LocalRun._pool is None:
            LocalRun._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-run")
        self.path = path
        self._done = LocalRun._pool.submit(run_swarm, "train", "--strategy", "local", *flags, "--save", path,
                                           timeout=timeout)
        self._saved = None

    def process(self):
        """The finished run (waits for it): a CompletedProcess, checked to have succeeded."""
        r = self._done.result()
        assert r.returncode == 0, r.stderr
        return r

    def checkpoint(self) -> dict:
        """The run's checkpoint (waits for it)."""
        import torch

        if self._saved is None:
            self.process()
            self._saved = torch.load(self.path, weights_only=True)
        return self._saved

    def weights(self) -> dict:
        return self.checkpoint()["model"]


def bed_in_use() -> bool:
    """Whether a testbed record is on this machine (one this swarm reads or not)."""
    from swarm.errors import SwarmError
    from swarm.testbed import testbed

    try:
        return testbed.load() is not None
    except SwarmError:
        return True


def namespace_testbed(devices: int = 4, *flags):
    """A generator for a fixture: `swarm testbed up` (skipping when one is already up on
    the machine), the testbed record, then `swarm testbed down` whatever happened."""
    from swarm.testbed import testbed

    if bed_in_use():
        pytest.skip("a namespace testbed is already up on this machine")
    up = run_swarm("testbed", "up", "--devices", devices, *flags, timeout=180)
    try:
        assert up.returncode == 0, up.stderr
        yield testbed.load()
    finally:
        run_swarm("testbed", "down", timeout=60)
