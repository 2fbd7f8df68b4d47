"""swarm.host.malloc: freed activations are reused without the kernel faulting their pages in again."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import mmap, resource, sys, numpy, torch
from swarm.host import malloc
malloc.tune()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
fresh = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
numpy.frombuffer(fresh, numpy.uint8).fill(3)  # what 64 MiB never used costs here
fresh_faults = faults() - before
torch.empty(64 << 20).fill_(1.0)  # 256 MiB, freed at once: room for what follows
before = faults()
torch.empty(16 << 20).fill_(2.0)  # 64 MiB
print(faults() - before, fresh_faults)
"""


def faults_of_second_block(env_extra: dict) -> tuple[int, int]:
    """The faults of a 64 MiB block after a 256 MiB one was freed, and of 64 MiB never used
    (16384 faults of 4 KiB pages, fewer where the kernel faults in larger folios)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    second, fresh = out.stdout.split()[-2:]
    return int(second), int(fresh)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_a_freed_block_is_reused_without_page_faults():
    second, fresh = faults_of_second_block({})
    assert second < min(1000, fresh / 4), (second, fresh)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_the_users_malloc_settings_have_the_last_word():
    second, fresh = faults_of_second_block({"MALLOC_ARENA_MAX": "2"})
    assert second > fresh / 2, (second, fresh)  # mapped afresh, as glibc does by default


# ---- jemalloc, where it is installed -----------------------------------------------------
from swarm.host import malloc  # noqa: E402
from tests.conftest import jemalloc_library  # noqa: E402

JEMALLOC = malloc.find_jemalloc()  # installed
JEMALLOC_LIBRARY = jemalloc_library()  # installed, or unpacked for the tests (.ci/run)
needs_jemalloc = pytest.mark.skipif(JEMALLOC_LIBRARY is None, reason="jemalloc is not installed here")


def test_swarm_starts_again_on_jemalloc_unless_the_user_chose():
    base = {"PATH": "/usr/bin", "HOME": "/root"}
    env = malloc.preload_environment(base, "/usr/lib/libjemalloc.so.2")
    assert env["LD_PRELOAD"] == "/usr/lib/libjemalloc.so.2" and env["MALLOC_CONF"] == malloc.JEMALLOC_CONF
    assert env["PATH"] == "/usr/bin" and env[malloc.PRELOADED] == env["LD_PRELOAD"]
    assert malloc.preload_environment(env, "/usr/lib/libjemalloc.so.2") is None  # started again already: no loop
    assert malloc.preload_environment(base, None) is None
    for chosen in ({"LD_PRELOAD": "/opt/libtcmalloc.so"}, {"MALLOC_ARENA_MAX": "2"}, {"MALLOC_CONF": "narenas:2"},
                   {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {"SWARM_MALLOC": "glibc"}):
        assert malloc.preload_environment(dict(base, **chosen), "/usr/lib/libjemalloc.so.2") is None, chosen


def test_other_programs_get_the_system_allocator_and_a_users_preload_stays():
    own = malloc.preload_environment({"PATH": "/usr/bin"}, "/usr/lib/libjemalloc.so.2")
    assert malloc.without_own_preload(own) == {"PATH": "/usr/bin"}
    users = {"PATH": "/usr/bin", "LD_PRELOAD": "/opt/libtcmalloc.so", "MALLOC_CONF": "x"}
    assert malloc.without_own_preload(users) == users
    assert malloc.without_own_preload(dict(users, **{malloc.PRELOADED: "/usr/lib/libjemalloc.so.2"})) == users


JE_PROBE = """
import resource, psutil, torch
from swarm.host import malloc
malloc.tune()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(64 << 20).fill_(1.0)
before = faults()
torch.empty(16 << 20).fill_(2.0)
reused = faults() - before
held = psutil.Process().memory_info().rss
malloc.give_back()
print(malloc.allocator(), reused, (held - psutil.Process().memory_info().rss) >> 20)
"""


@needs_jemalloc
def test_on_jemalloc_freed_blocks_are_reused_and_given_back_after_a_job():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env.update(PYTHONPATH=str(ROOT), LD_PRELOAD=JEMALLOC_LIBRARY, MALLOC_CONF=malloc.JEMALLOC_CONF)
    out = subprocess.run([sys.executable, "-c", JE_PROBE], capture_output=True, text=True, env=env, check=True)
    name, reused, returned = out.stdout.split()
    assert name == "jemalloc"
    assert int(reused) < 1000  # 64 MiB is 16384 pages
    assert int(returned) >= 200  # of the 256 MiB block kept for reuse until then


def test_the_swarm_command_runs_on_jemalloc_where_it_is_installed(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "SWARM_MALLOC")}
    env.update(PYTHONPATH=str(ROOT))
    probe = "import runpy, sys; sys.argv = ['swarm', '--version']; runpy.run_module('swarm', run_name='__main__')"
    # what `python -m swarm` runs, with a look at the allocator it ended on
    code = ("import atexit; from swarm.host import malloc; atexit.register(lambda: print(malloc.allocator()));"
            + probe)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split()[-1] == ("jemalloc" if JEMALLOC else "glibc"), out
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(env, SWARM_MALLOC="glibc"))
    assert out.stdout.split()[-1] == "glibc", out


def test_a_command_that_trains_on_glibc_starts_again_without_glibcs_small_chunk_cache():
    """The tcache can only be turned off at a process's start (swarm.host.malloc)."""
    base = {"PATH": "/usr/bin"}
    env = malloc.preload_environment(base, None, glibc=True)
    assert env == dict(base, GLIBC_TUNABLES=malloc.GLIBC_TUNABLES, **{malloc.PRELOADED: "glibc"})
    assert malloc.preload_environment(env, None, glibc=True) is None  # started again already: no loop
    assert malloc.preload_environment(base, None) is None  # a command that does not train
    assert malloc.preload_environment(dict(base, SWARM_MALLOC="glibc"), "/usr/lib/libjemalloc.so.2", glibc=True) \
        == dict(base, SWARM_MALLOC="glibc", GLIBC_TUNABLES=malloc.GLIBC_TUNABLES, **{malloc.PRELOADED: "glibc"})
    for chosen in ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {"MALLOC_ARENA_MAX": "2"},
                   {"LD_PRELOAD": "/opt/libtcmalloc.so"}):
        assert malloc.preload_environment(dict(base, **chosen), None, glibc=True) is None, chosen
    assert malloc.without_own_preload(env) == base


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_swarm_train_runs_with_glibcs_tunables_and_status_starts_once(tmp_path):
    """What `swarm train` and `swarm status` end on, seen from inside (a sitecustomize prints it at exit)."""
    if JEMALLOC is not None:
        env_extra = {"SWARM_MALLOC": "glibc"}  # (where jemalloc is installed, swarm runs on it otherwise)
    else:
        env_extra = {}
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, os\natexit.register(lambda: print('TUNABLES', os.environ.get('GLIBC_TUNABLES', '-')))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES",
                                                                                          malloc.PRELOADED)}
    env.update(PYTHONPATH=f"{tmp_path}:{ROOT}", **env_extra)
    for command, expected in ((["train", "--help"], malloc.GLIBC_TUNABLES), (["status", "--help"], "-")):
        out = subprocess.run([sys.executable, "-m", "swarm", *command], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == f"TUNABLES {expected}", out.stdout[-300:]


# ---- glibc as swarm starts it, and plans that map --------------------------------------------
def test_glibc_is_not_asked_for_huge_pages():
    """On a device whose memory is nearly all in use the kernel compacts memory for each huge
    page a fault asks for: a 1 GiB device paid more system time in them (swarm.host.malloc)."""
    env = malloc.preload_environment({"PATH": "/usr/bin"}, None, glibc=True)
    assert env["GLIBC_TUNABLES"] == malloc.GLIBC_TUNABLES and "hugetlb" not in env["GLIBC_TUNABLES"]
    assert malloc.preload_environment(env, None, glibc=True) is None  # started again already
    assert malloc.without_own_preload(env) == {"PATH": "/usr/bin"}


MAPPED_PROBE = """
import resource, sys, psutil, torch
from swarm.host import malloc
malloc.tune()
mapped = malloc.map_large(sys.argv[1] == "map")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rss = psutil.Process().memory_info().rss
torch.empty(64 << 20).fill_(1.0)  # 256 MiB, freed at once
after = psutil.Process().memory_info().rss
before = faults()
torch.empty(16 << 20).fill_(2.0)  # 64 MiB
print(malloc.allocator(), mapped, faults() - before, (after - rss) >> 20)
"""


def test_a_plan_that_maps_gives_its_largest_blocks_back_on_free():
    """The `swarm` command's glibc (swarm.host.malloc): its heap keeps a freed block for reuse;
    a plan that maps (map_large) unmaps it when freed, so the process holds what it uses, and
    faults a block in again when it next needs one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "SWARM_MALLOC")}
    env.update(PYTHONPATH=str(ROOT), GLIBC_TUNABLES=malloc.GLIBC_TUNABLES, **{malloc.PRELOADED: "glibc"})
    runs = {}
    for how in ("heap", "map"):
        out = subprocess.run([sys.executable, "-c", MAPPED_PROBE, how], capture_output=True, text=True, env=env,
                             check=True)
        name, mapped, faults, kept = out.stdout.split()
        assert name == "glibc" and mapped == str(how == "map")
        runs[how] = int(faults), int(kept)
    assert runs["heap"][1] >= 250 and runs["heap"][0] < 1000  # kept for reuse, used again without faults
    assert runs["map"][1] < 50  # given back
    assert runs["map"][0] > runs["heap"][0]  # faulted in again (here 4205 times against none)


RESERVE_PROBE = """
import resource, sys, psutil, torch
from swarm.host import malloc
malloc.tune()
rss = psutil.Process().memory_info().rss
reserved = malloc.reserve(rss + (300 << 20)) if sys.argv[1] == "reserve" else 0
held = psutil.Process().memory_info().rss - rss
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [torch.ones(21 << 18) for _ in range(12)]  # a run's maps: 12 of 21 MiB, then freed
del blocks
blocks = [torch.ones(5 << 18) for _ in range(40)]  # and of other sizes
del blocks
print(malloc.allocator(), reserved >> 20, held >> 20, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("environment", ["swarm", "user"])
def test_a_reserved_heap_is_faulted_in_before_the_run_and_used_without_faults(environment):
    """malloc.reserve (what a train job does before its first step, up to the plan's predicted
    peak): the heap's room is faulted in at once, and the blocks a run then allocates in it
    fault no page; a process not started as `swarm` starts itself on glibc (here without its
    tunables, as a user's own settings would be) is left as it is."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "SWARM_MALLOC", "GLIBC_TUNABLES")}
    env["PYTHONPATH"] = str(ROOT)
    if environment == "swarm":
        env.update(GLIBC_TUNABLES=malloc.GLIBC_TUNABLES, **{malloc.PRELOADED: "glibc"})
    runs = {}
    for how in ("reserve", "grow"):
        out = subprocess.run([sys.executable, "-c", RESERVE_PROBE, how], capture_output=True, text=True, env=env,
                             check=True)
        name, reserved, held, faults = out.stdout.split()
        assert name == "glibc"
        runs[how] = int(reserved), int(held), int(faults)
    grown = runs["grow"][2]
    assert grown > 60000  # 252 MiB faulted in as the run went (64512 pages of 4 KiB)
    if environment == "swarm":
        assert 300 <= runs["reserve"][0] <= 310 and 300 <= runs["reserve"][1] <= 320
        assert runs["reserve"][2] < 1000
    else:
        assert runs["reserve"][0] == 0 and runs["reserve"][1] < 16
        assert runs["reserve"][2] > 60000


FROZEN = """
import gc, weakref
from swarm.agent.jobs import job_runner
from swarm.host import malloc
assert "torch" not in __import__("sys").modules
job_runner("bandwidth")  # no torch: nothing frozen yet
unfrozen = gc.get_freeze_count()
young = gc.get_stats()[0]["collections"]
job_runner("train")  # the first kind that imports torch: no collections while it imports
assert gc.get_stats()[0]["collections"] == young and gc.isenabled(), (young, gc.get_stats())
import torch
walked = len(gc.get_objects())  # what a full collection now walks
# a job's model in a reference cycle, dropped, is still collected by release()
net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
net.me = [net]
gone = weakref.ref(net)
del net
malloc.release()
print(unfrozen, gc.get_freeze_count(), walked, gone() is None)
"""


def test_an_agents_first_torch_job_sets_torchs_modules_out_of_the_collectors_walks():
    """release()'s full collection (several a job) walked every object torch's import made,
    0.1 CPU s each here; once an agent has imported torch for a job they are frozen, and what
    a job leaves in reference cycles is still collected. The import itself runs without
    collections, and the collector is on again after it."""
    out = subprocess.run([sys.executable, "-c", FROZEN], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    unfrozen, frozen, walked, collected = out.stdout.split()
    assert int(unfrozen) == 0
    assert int(frozen) > 100_000 and int(walked) < int(frozen) / 10, (frozen, walked)
    assert collected == "True"
