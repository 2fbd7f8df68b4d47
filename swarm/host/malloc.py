"""Which allocator swarm processes run on, and how they ask it to behave.

Where jemalloc is installed (`libjemalloc2` on Debian and Raspberry Pi OS), the `swarm`
command runs itself on it (`preload`: it starts again at once with LD_PRELOAD, keeping its
process id). Training's large activations of varying sizes fragment glibc's one heap: one
process training yolov2-16 at 416 on micro-batches of 4 samples peaked at 1703 MiB resident
(VmHWM, torch's libraries included) with the glibc settings below and at 992 MiB on jemalloc
(1 sample 659 against 560 MiB, 2 samples 1088 against 705), at the same CPU time and with
no page faults once warm, since jemalloc keeps freed pages for reuse too (JEMALLOC_CONF). A
device that holds more samples of a micro-batch needs fewer partners and fewer BatchNorm
exchanges; the planner's memory model knows which allocator each device's profile ran on
(planner.memory.ALLOCATORS).

Training allocates and frees the same large activations every micro-batch. By default glibc
serves each block above its mmap threshold with a fresh mapping and unmaps it on free, so the
kernel faults in and zeroes every page again on the next use: a fifth of a tiles device's CPU
time went to page faults and page clearing (2x2 tiles of yolov2-16 at 416, batch 8, in one
process: 0.6-1.2 s of system time in a 3.8-4.4 s pass; with the settings below none, 3.1 s a
pass, and a peak resident size 3% higher). And each compute thread would get its own arena, where freed activations stay: a
one-stage job peaked 50% above local training (1.10 vs 0.74 GB at 416x416) and a 1 GiB device
ran out.

So, on glibc: one arena, every block from the heap (no mmap), and freed memory kept for reuse
instead of trimmed after each free; on jemalloc the same in its terms. `give_back()` returns
it to the system when a job ends. A user who sets LD_PRELOAD, MALLOC_*, GLIBC_TUNABLES or
SWARM_MALLOC=glibc in the environment has the last word.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import glob
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# one arena (as on glibc: each thread's own would keep its freed activations), and freed pages
# kept for the next micro-batch rather than returned and faulted in again (give_back does that)
JEMALLOC_CONF = "narenas:1,dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_PATHS = ("/usr/lib/*-linux-gnu*/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2",
                  "/usr/local/lib/libjemalloc.so.2")
PRELOADED = "SWARM_PRELOADED"  # set to the library when swarm preloaded it itself (not the user)
MALLCTL_ARENAS_ALL = 4096


def find_jemalloc() -> str | None:
    """The installed jemalloc library, if any."""
    if not sys.platform.startswith("linux"):
        return None
    for pattern in JEMALLOC_PATHS:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return path
    return None


def preload_environment(environ: dict[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to start this command again in on `library` (jemalloc), or None to
    stay: no library, already preloaded, or the user chose the allocator's settings."""
    if library is None or environ.get("SWARM_MALLOC", "").lower() in ("glibc", "system") or "LD_PRELOAD" in environ \
            or any(k.startswith("MALLOC_") for k in environ) or "GLIBC_TUNABLES" in environ:
        return None
    return dict(environ, LD_PRELOAD=library, MALLOC_CONF=JEMALLOC_CONF, **{PRELOADED: library})


def preload() -> None:
    """Start this command again on jemalloc when it is installed (the first thing the `swarm`
    command does, before torch is loaded). Same process, same arguments; on any failure it
    just goes on with the allocator it has."""
    env = preload_environment(dict(os.environ), find_jemalloc())
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv or not sys.executable:
        return
    try:
        sys.stdout.flush(), sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    except OSError:
        return


def without_own_preload(environ: dict[str, str]) -> dict[str, str]:
    """`environ` less the preload swarm set itself: for the other programs it starts (a
    `swarm` started from it preloads again; a user's LD_PRELOAD stays)."""
    if PRELOADED not in environ:
        return dict(environ)
    env = {k: v for k, v in environ.items() if k != PRELOADED}
    if env.get("LD_PRELOAD") == environ[PRELOADED]:
        env.pop("LD_PRELOAD")
        if env.get("MALLOC_CONF") == JEMALLOC_CONF:
            env.pop("MALLOC_CONF")
    return env


def _jemalloc():
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return mallctl


def allocator() -> str:
    """The allocator this process runs on: "jemalloc", "glibc" or "other"."""
    if _jemalloc() is not None:
        return "jemalloc"
    return "glibc" if _libc() is not None else "other"


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc has both)
    except (OSError, AttributeError):
        return None  # not glibc
    return libc


def tune() -> None:
    """Settings for a training process (call before large allocations)."""
    if any(k.startswith("MALLOC_") for k in os.environ) or "GLIBC_TUNABLES" in os.environ or _jemalloc() is not None:
        return
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def give_back() -> None:
    """Return the heap's free pages to the system (after a job, before measuring memory)."""
    mallctl = _jemalloc()
    if mallctl is not None:
        mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0)
        return
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def release() -> None:
    """Collect what ended work left in reference cycles (torch modules, autograd graphs) and
    return the heap's free pages to the system: a process's memory then follows what it
    holds now, not the largest it ever held."""
    gc.collect()
    give_back()
