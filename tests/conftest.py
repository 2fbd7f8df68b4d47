"""Test set-up shared by every test: discovery pinned to loopback, small thread counts, no silent skips in CI."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Under CI=true (.ci/run sets it) nothing CI is meant to run may skip: a test skips there only
# for one of these reasons, what a CI machine may lack without the suite testing less than CI
# means it to; any other skip (no root for the testbed, a testbed already up, a test extra
# not installed) fails the test (pytest_runtest_makereport below).
IN_CI = os.environ.get("CI", "").lower() == "true"
ALLOWED_SKIPS = (
    "no CUDA device on this machine",  # test_cuda, test_tiles_graph
    "a CUDA device is here",           # test_planner_cli: what a machine without CUDA prints
    "jemalloc is not installed here",  # test_malloc, test_memory_model: an optional system library
    "systemd-analyze not installed",   # test_deploy_unit: .ci/run installs it where it can and says when not
    "no external interface here",      # test_discovery: a container with loopback alone
)

# Discovery and connections never leave the machine in tests: every swarm command (and
# every subprocess a test starts) sees this unless a test pins another interface itself.
os.environ["SWARM_INTERFACE"] = "lo"
os.environ["SWARM_CONFIG"] = os.devnull  # never the machine's own /etc/swarm/swarm.toml
# The suite runs on glibc where jemalloc is not installed: a `swarm` command it starts neither
# fetches Debian's jemalloc nor runs on one fetched before (swarm.host.malloc; the allocator tests
# preload jemalloc themselves, and tests/test_malloc_fetch.py fetches from a fake apt).
os.environ["SWARM_FETCH_JEMALLOC"] = "0"

# On several workers (below) tests compute beside each other, and an OpenMP team that spins while
# it waits, as libgomp's does by default, takes the core from the test beside it: two
# two-thread trainings side by side each took 11x as long as one alone, and 1.7x with a
# short spin (set before torch is imported; the subprocesses a test starts inherit it).
# And each process computes on one thread (swarm.host.resources.compute_threads honours
# OMP_NUM_THREADS, as torch does): with both cores busy, a local run of yolov2-16 at 128 beside a
# busy process took 15.7-17.4 CPU-s on two threads with that short spin, 13.7-14.2 on one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    """Where the environment keeps Python from writing bytecode (PYTHONDONTWRITEBYTECODE, as
    some CI machines set), compile swarm, planner and tiles once before the workers start: the
    suite starts some 180 `swarm` commands and scripts and dozens of testbed agents, and each
    compiled every swarm module it imported from source again (a `swarm train` 0.4-0.5 CPU s
    more, a `swarm plan` 0.15). Files already compiled are left as they are."""
    if hasattr(config, "workerinput") or not sys.dont_write_bytecode:
        return
    import compileall

    for package in ("swarm", "planner", "tiles"):
        compileall.compile_dir(ROOT / package, quiet=1)


# The suite runs on three processes (pytest -n 3, the README's command). The modules below
# share something machine-wide, so they run one after another on one of them: the namespace
# testbed (one per machine), agents advertising on loopback's mDNS, and checks of how long
# something took or how much memory it reached. Meanwhile the other processes run the rest,
# at a lower priority (_prioritise). On two cores, two processes left one core idle while the
# machine-wide tests waited (on heartbeats, elections, timeouts): about 160 core-seconds of
# a run idle, against 14 with three (1119 s and 958 s, in runs an hour apart).
MACHINE_WIDE = {
    "test_agent", "test_agent_bounds", "test_auth", "test_chaos_run", "test_clean_stop", "test_cuda",
    "test_deploy_notify", "test_detached", "test_discovery", "test_failover", "test_flapping", "test_memory_model",
    "test_planner_live", "test_service_install", "test_status", "test_swarm_detached", "test_swarm_replay",
    "test_swarm_spare_memory", "test_swarm_training", "test_testbed", "test_torch_libs", "test_wire_sockets",
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


def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: why")
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr)


def _fail_unexpected_skip(report, testbed: bool = False) -> None:
    """Under CI=true, turn a skip whose reason is not in ALLOWED_SKIPS into a failure."""
    if not IN_CI or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(allowed in reason for allowed in ALLOWED_SKIPS):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true: {reason}\nIn CI a test may skip only for what a CI machine may "
                       f"lack (ALLOWED_SKIPS in tests/conftest.py); give this machine what the test needs"
                       + (" (the testbed tests: root, and no testbed up)" if testbed else "") + ".")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result(), item.get_closest_marker("testbed") is not None)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())  # a module skipped as a whole


def pytest_runtest_setup(item):
    """Before each test (and its fixtures): its worker's priority (_prioritise); before a
    testbed test, clear a testbed left by an earlier run whose processes are all gone, so that
    it does not keep this one from running."""
    _prioritise(_module_of(item.nodeid) in MACHINE_WIDE)
    if item.get_closest_marker("testbed") is not None and os.geteuid() == 0:
        clear_stale_testbed()


# The machine-wide tests wait a good part of their time (heartbeats, elections, a testbed's
# timeouts) and must not be slowed by the rest where they time something; the other workers
# fill the cores meanwhile, at a lower priority (nice 5: a third of a machine-wide process's
# share of a core they contend for, so that they still keep their own few timings). Linux
# keeps a nice value per thread, so every thread of the worker is set, and the processes a
# test starts inherit it. Raising a priority again needs root; elsewhere a worker stays at
# what it reached (it then runs no testbed test).
BESIDE_NICE = 5


def _prioritise(machine_wide: bool) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") or not sys.platform.startswith("linux"):
        return
    want = 0 if machine_wide else BESIDE_NICE
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != want:
                os.setpriority(os.PRIO_PROCESS, int(tid), want)
        except OSError:  # a thread that has ended, or no right to raise a priority
            pass


@pytest.fixture(autouse=True)
def _pin_interface(monkeypatch):
    monkeypatch.setenv("SWARM_INTERFACE", os.environ.get("SWARM_TEST_INTERFACE", "lo"))


def jemalloc_library() -> str | None:
    """The jemalloc the allocator tests preload: SWARM_TEST_JEMALLOC (a library unpacked from its
    package, not installed, as .ci/run fetches it: the rest of the suite stays on glibc), else
    the installed one, else None."""
    from swarm.host import malloc

    given = os.environ.get("SWARM_TEST_JEMALLOC")
    return given if given and os.path.isfile(given) else malloc.find_jemalloc()


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


def testbed_processes() -> list[int]:
    """The live processes of a namespace testbed on this machine, found without its record:
    those whose command line names its folder (its agents), those running `swarm testbed`
    (an `up` before it has started an agent), and those in its namespaces or cgroups."""
    import shutil

    from swarm.testbed import cgroups, netns, testbed
    from swarm.testbed.names import state_dir

    folder = f"{state_dir()}/".encode()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if any(folder in arg for arg in args) or any(
                arg == b"testbed" and args[i - 1].rpartition(b"/")[2] == b"swarm" for i, arg in enumerate(args) if i):
            found.add(int(entry.name))
    if shutil.which("ip"):
        for ns in netns.namespaces():
            found |= set(netns.namespace_pids(ns))
    host = cgroups.detect()
    for group in host.group_dirs() if host else []:
        for directory in [group, *(group.iterdir() if group.is_dir() else [])]:
            found |= set(cgroups.processes(directory))
    found.discard(os.getpid())
    return sorted(pid for pid in found if testbed._alive(pid))


def testbed_left_over() -> bool:
    """Whether anything of a namespace testbed is on this machine: its record (readable or not),
    its namespaces, links or cgroups."""
    import shutil

    from swarm.testbed import cgroups, netns, testbed

    host = cgroups.detect()
    return (testbed.record_path().exists() or any(d.exists() for d in (host.group_dirs() if host else []))
            or bool(shutil.which("ip") and (netns.namespaces() or netns.links())))


def clear_stale_testbed() -> None:
    """`swarm testbed down` for a testbed an earlier run left on this machine, when none of its
    processes is alive (a testbed in use is left alone); said as a warning."""
    if not testbed_left_over() or testbed_processes():
        return
    down = run_swarm("testbed", "down", timeout=60)
    assert down.returncode == 0, f"`swarm testbed down` of a testbed left over failed: {down.stderr}"
    warnings.warn(f"cleared a namespace testbed left by an earlier run, its processes gone ({down.stdout.strip()})",
                  stacklevel=1)


def testbed_unavailable(why: str):
    """A testbed test that cannot get its testbed: skipped, or under CI=true failed."""
    if IN_CI:
        pytest.fail(f"{why}; under CI=true a testbed test must run, not skip", pytrace=False)
    pytest.skip(why)


def namespace_testbed(devices: int = 4, *flags):
    """A generator for a fixture: `swarm testbed up` (after clearing one an earlier run left;
    skipping, or failing under CI=true, when one is in use on the machine), the testbed
    record, then `swarm testbed down` whatever happened."""
    from swarm.errors import SwarmError
    from swarm.testbed import testbed

    if os.geteuid() != 0:
        testbed_unavailable("the namespace testbed needs root")
    clear_stale_testbed()
    try:
        in_use = testbed.load() is not None
    except SwarmError as exc:
        testbed_unavailable(f"a namespace testbed's processes are alive and its record is unreadable: {exc}")
    if in_use or testbed_left_over():
        testbed_unavailable(f"a namespace testbed is in use on this machine (processes {testbed_processes()}; "
                            f"`swarm testbed status` shows it)")
    up = run_swarm("testbed", "up", "--devices", devices, *flags, timeout=180)
    try:
        assert up.returncode == 0, up.stderr
        yield testbed.load()
    finally:
        run_swarm("testbed", "down", timeout=60)
