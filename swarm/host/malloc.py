"""Which allocator swarm processes run on, and how they ask it to behave.

Where jemalloc is installed (`libjemalloc2` on Debian and Raspberry Pi OS), the `swarm`
command runs itself on it (`preload`: it starts again at once with LD_PRELOAD, keeping its
process id); where it is not but apt is, on Debian's package, which the first command that
trains fetches into this install without installing it (fetch_jemalloc). Training's large
activations of varying sizes fragment glibc's one heap: one process training yolov2-16 at 416
on micro-batches of 4 samples peaked at 1703 MiB resident (VmHWM, torch's libraries included)
with the glibc settings below and at 992 MiB on jemalloc (1 sample 659 against 560 MiB, 2
samples 1088 against 705), at the same CPU time and with no page faults once warm, since
jemalloc keeps freed pages for reuse too (JEMALLOC_CONF). A device that holds more samples of
a micro-batch needs fewer partners and fewer BatchNorm exchanges; the planner's memory model
knows which allocator each device's profile ran on (planner.memory.ALLOCATORS).

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

On glibc the one heap fragmented even so, and more with every micro-batch: small freed
chunks that glibc holds back for quick reuse (its per-thread cache, "tcache", and its
fastbins) count as in use, so the large free blocks on either side of one cannot merge, and
the next large activation extends the heap instead. One process training yolov2-16 at 416 on
4-sample micro-batches (bench/allocator_peaks.py, 3 rounds) peaked 1074-1251 MiB above its
start after 6 of them, growing by 85 MiB steps (850 after the first, 1211 after the twelfth);
with neither cache 851-866 MiB, flat from the fourth (in five more rounds on a quiet machine
836-890 against 999-1191); jemalloc 611. With sizes that vary (4, 2, 3 samples in turn)
1228-1432 against 776-854 (jemalloc 646); the same CPU time. Fastbins are turned off at run
time (M_MXFAST 0); the tcache only at a process's start (GLIBC_TUNABLES), so the `swarm`
command training on glibc starts itself again with it (`preload`), as it does on jemalloc.

A plan may also have every block of MAPPED_FROM or more served from a mapping of its own,
unmapped on free (`map_large`, Plan.mapped). Those are the largest maps of a micro-batch (at
416 the first layers' outputs, 11 MB a sample): they no longer leave holes in the heap that the
next maps of other sizes cannot use. yolov2-16 at 416 on 4-sample passes held 525 MiB above
the start, flat, against 800-877 in the heap and 611 on jemalloc; but each pass faults its
mapped blocks in again, zeroed by the kernel. So the planner weighs it (planner.mapping), at
the cost per byte each device's profile measures (swarm.profiling.mapping).

glibc is not asked for transparent huge pages (its tunable glibc.malloc.hugetlb=1, which swarm
set where the kernel had them, until 2026-12). On a device whose memory is nearly all in use,
as on a 1 GiB device holding a micro-batch, the kernel compacts memory to find each huge page
a fault asks for: in a 0.2-core, 1 GiB cgroup, 4-sample passes of yolov2-16 at 416 took
2.9-4.5 s of system time mapped in huge pages against 1.8-1.9 in small ones (the same peak),
and 2 samples in the heap 0.52-0.58 against 0.17 (bench/RESULTS.md, 2026-12-01).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import gc
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

M_MXFAST, M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = 1, -1, -3, -4, -8
# glibc: no per-thread cache of small freed chunks (what mallopt cannot change once running)
GLIBC_TUNABLES = "glibc.malloc.tcache_count=0"
# on glibc as swarm starts it, where a plan maps (map_large): blocks this large or larger get their
# own mapping (M_MMAP_THRESHOLD; planner.mapping.MAPPED_FROM)
MAPPED_FROM = 4 << 20
MAX_MAPPED = 1 << 16  # mappings at once (glibc's default)
# the commands whose processes train or profile (the rest allocate little, and start once)
COMPUTING = ("train", "join", "profile", "eval", "detect", "export", "plan")
# one arena (as on glibc: each thread's own would keep its freed activations), and freed pages
# kept for the next micro-batch rather than returned and faulted in again (give_back does that)
JEMALLOC_CONF = "narenas:1,dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_PATHS = ("/usr/lib/*-linux-gnu*/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2",
                  "/usr/local/lib/libjemalloc.so.2")
PRELOADED = "SWARM_PRELOADED"  # the library swarm preloaded itself (not the user), or "glibc" for its tunables
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


# ---- jemalloc where it is not installed: Debian's package, fetched without installing it --------
# On Debian and the systems built on it (Ubuntu, Raspberry Pi OS, NVIDIA's Jetson Linux) a `swarm`
# set up with pip alone fetches Debian's libjemalloc2 the first time a command that trains starts:
# `apt-get download` (which checks the package against the system's signed package lists; no root)
# and `dpkg-deb -x` (which only unpacks: no package scripts run), into a folder of this install,
# and runs on it from then on, as where it is installed. SWARM_FETCH_JEMALLOC=0 neither fetches
# nor runs on one fetched before; SWARM_MALLOC=glibc keeps glibc's malloc either way.
JEMALLOC_PACKAGE = "libjemalloc2"
JEMALLOC_FILE = "libjemalloc.so.2"
FETCH = "SWARM_FETCH_JEMALLOC"
FETCH_TIMEOUT_S = 30.0  # each of the two commands (an offline device: its package lists' mirror unreachable)
FETCH_RETRY_S = 24 * 3600.0  # after a failed fetch, the next try


def fetched_dirs() -> list[Path]:
    """Where a fetched jemalloc is kept: SWARM_JEMALLOC_DIR where set, else in this install (its
    virtual environment), or where that cannot be written, the user's cache."""
    if os.environ.get("SWARM_JEMALLOC_DIR"):
        return [Path(os.environ["SWARM_JEMALLOC_DIR"])]
    install = Path(sys.prefix) / "lib" / "swarm-jemalloc"
    try:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home directory to be found
        return [install]
    return [install, cache / "swarm" / "jemalloc"]


def fetched_jemalloc() -> str | None:
    """The jemalloc library fetched before, if any."""
    for folder in fetched_dirs():
        if (folder / JEMALLOC_FILE).is_file():
            return str(folder / JEMALLOC_FILE)
    return None


def may_fetch(environ) -> bool:
    """Whether a command may fetch jemalloc: on Linux, unless the environment says not to, keeps
    glibc (SWARM_MALLOC) or sets the allocator itself."""
    return (sys.platform.startswith("linux") and environ.get(FETCH, "1") != "0"
            and environ.get("SWARM_MALLOC", "").lower() not in ("glibc", "system") and not _users_choice(environ))


def fetch_jemalloc(timeout: float = FETCH_TIMEOUT_S) -> str | None:
    """Debian's jemalloc, fetched and unpacked into the first of fetched_dirs() that can be
    written (once: processes starting together wait for one fetch); its path, or None where
    there is no apt-get and dpkg-deb, the fetch fails (then not tried again for FETCH_RETRY_S),
    or the folder cannot be written. Says so on stderr when it fetched."""
    apt, unpack = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt is None or unpack is None:
        return None
    for folder in fetched_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = open(folder / ".lock", "a")
        except OSError:
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:  # a file system without locks
                continue
            return _fetch_into(folder, apt, unpack, timeout)
    return None


def _fetch_into(folder: Path, apt: str, unpack: str, timeout: float) -> str | None:
    library, failed = folder / JEMALLOC_FILE, folder / "failed"
    if library.is_file():
        return str(library)  # another process fetched it meanwhile
    with contextlib.suppress(OSError):
        if time.time() - failed.stat().st_mtime < FETCH_RETRY_S:
            return None
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
             "timeout": timeout, "check": True}
    try:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            subprocess.run([apt, "download", "-q", "-o", "Acquire::Retries=0", "-o", f"Acquire::http::Timeout={timeout:.0f}",
                            JEMALLOC_PACKAGE], cwd=tmp, **quiet)
            (package,) = Path(tmp).glob(f"{JEMALLOC_PACKAGE}_*.deb")
            root = Path(tmp) / "root"
            subprocess.run([unpack, "-x", str(package), str(root)], **quiet)
            found = sorted(p.resolve() for p in root.rglob(JEMALLOC_FILE) if p.is_file())
            if not found or not found[0].is_relative_to(root.resolve()):
                raise ValueError(f"{package.name} has no {JEMALLOC_FILE}")
            part = folder / (JEMALLOC_FILE + ".part")
            shutil.copyfile(found[0], part)
            os.replace(part, library)
            (folder / "SOURCE").write_text(package.name + "\n")
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        with contextlib.suppress(OSError):
            failed.touch()
        print(f"swarm: could not fetch jemalloc ({type(exc).__name__}); training runs on glibc's malloc, "
              f"and the fetch is tried again in a day", file=sys.stderr)
        return None
    print(f"swarm: jemalloc is not installed here; fetched Debian's {package.name} into {folder} and runs on it "
          f"from now on (SWARM_MALLOC=glibc keeps glibc's malloc)", file=sys.stderr)
    return str(library)


def jemalloc_library(environ=os.environ, fetch: bool = False) -> str | None:
    """The jemalloc a `swarm` command runs on: the installed one, else the one fetched before,
    else (with `fetch`, where may_fetch) one fetched now."""
    found = find_jemalloc()
    if found is None and may_fetch(environ):
        found = fetched_jemalloc() or (fetch_jemalloc() if fetch else None)
    return found


def _users_choice(environ) -> bool:
    """Whether the environment sets the allocator or its settings (swarm's own start aside)."""
    own = environ.get(PRELOADED)
    if own == "glibc" and environ.get("GLIBC_TUNABLES") == GLIBC_TUNABLES:
        environ = {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}
    elif own is not None and environ.get("LD_PRELOAD") == own:
        environ = {k: v for k, v in environ.items() if k != "LD_PRELOAD" and
                   not (k == "MALLOC_CONF" and v == JEMALLOC_CONF)}
    return "LD_PRELOAD" in environ or any(k.startswith("MALLOC_") for k in environ) or "GLIBC_TUNABLES" in environ


def preload_environment(environ: dict[str, str], library: str | None, glibc: bool = False) -> dict[str, str] | None:
    """The environment to start this command again in: on `library` (jemalloc), or else, with
    `glibc`, with GLIBC_TUNABLES; None to stay: nothing to change, started again already, or
    the user chose the allocator's settings."""
    if environ.get("SWARM_MALLOC", "").lower() in ("glibc", "system"):
        library = None  # the system's allocator, with swarm's settings for it
    if PRELOADED in environ or _users_choice(environ):
        return None
    if library is not None:
        return dict(environ, LD_PRELOAD=library, MALLOC_CONF=JEMALLOC_CONF, **{PRELOADED: library})
    if glibc:
        return dict(environ, GLIBC_TUNABLES=GLIBC_TUNABLES, **{PRELOADED: "glibc"})
    return None


def _swarm_glibc(environ=os.environ) -> bool:
    """Whether this process was started by swarm on glibc with its tunables."""
    return environ.get(PRELOADED) == "glibc" and environ.get("GLIBC_TUNABLES") == GLIBC_TUNABLES


def preload(argv: list[str] | None = None) -> None:
    """Start this command again on jemalloc when it is installed or fetched (a command that
    trains fetches it where it may: jemalloc_library), or with glibc's tunables
    when a command that trains runs on glibc (the first thing the `swarm` command does,
    before torch is loaded). Same process, same arguments; on any failure it just goes on
    with the allocator it has."""
    args = sys.argv[1:] if argv is None else argv
    computing = any(a in COMPUTING for a in args[:1])
    try:
        library = jemalloc_library(fetch=computing and PRELOADED not in os.environ)
    except Exception:  # noqa: BLE001 (the allocator is an optimisation: the command runs either way)
        library = find_jemalloc()
    env = preload_environment(dict(os.environ), library, glibc=computing and _libc() is not None)
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
    if environ[PRELOADED] == "glibc":
        if env.get("GLIBC_TUNABLES") == GLIBC_TUNABLES:
            env.pop("GLIBC_TUNABLES")
    elif env.get("LD_PRELOAD") == environ[PRELOADED]:
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
    """The allocator this process runs on: "jemalloc", "glibc" or "other". (Profiles made
    before 2026-12 may say "glibc-thp": glibc with its heap in huge pages.)"""
    if _jemalloc() is not None:
        return "jemalloc"
    if _libc() is None:
        return "other"
    return "glibc"


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
    if _users_choice(os.environ) or _jemalloc() is not None:
        return
    libc = _libc()
    if libc is None:
        return
    libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_MXFAST, 0)


def can_map() -> bool:
    """Whether this process can serve its largest blocks from mappings of their own
    (map_large): glibc, as `swarm` starts it (a user's own settings stay as they are)."""
    return allocator() == "glibc" and _swarm_glibc()


def map_large(on: bool) -> bool:
    """Serve every block of MAPPED_FROM or more from a mapping of its own, unmapped on free
    (on), or from the heap (off, as tune() sets); only where can_map(). Whether it now maps."""
    if not can_map():
        return False
    libc = _libc()
    if on:
        libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)
        libc.mallopt(M_MMAP_MAX, MAX_MAPPED)
    else:
        libc.mallopt(M_MMAP_MAX, 0)
    return on



RESERVE_PIECE = 8 << 20  # reserve() takes the heap's free room in blocks of this size
RESERVE_LEAST = 16 << 20  # and does not bother for less


def reserve(resident: int) -> int:
    """Fault in now the heap a run will grow to: take free blocks from the heap (its free room
    first, then more from the system) until this process holds `resident` bytes, write to
    them, and free them again. They stay in the heap, resident, for the run's activations
    (glibc as `swarm` runs it keeps freed memory: tune()). The bytes faulted in; 0 where this
    process does not run on glibc as swarm starts it. (Call it with large blocks served from
    the heap: not under map_large.)

    Why: a device's heap on glibc goes on growing for several steps of a run, a large
    activation at a time where no free block in it is large enough, and each growth is
    faulted in mid-step. 0.2-core, 1 GiB testbed devices training yolov2-16 at 416 on
    4-sample micro-batches faulted 10,800-43,000 pages in some steps (multiples of 21 MiB,
    one map), 46-62 microseconds of system time a page that close to their limit, so that
    one device a step took 16.4-20 s where the rest took 13.4-14.2 and all waited for it.
    The placement of blocks does not change (the heap's free room is where it would have
    grown); only when its pages are faulted in: here before the first step, where the first
    step would fault most of them anyway, up to what the plan predicts the device holds."""
    if not can_map():
        return 0
    import psutil

    process = psutil.Process()
    grow = resident - process.memory_info().rss
    if grow < RESERVE_LEAST:
        return 0
    libc = _libc()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    # freeing it all at once must not hand the top of the heap back to the system
    libc.mallopt(M_TRIM_THRESHOLD, max(1 << 30, grow + (64 << 20)))
    libc.mallopt(M_MMAP_MAX, 0)  # (as tune() leaves it; map_large may map them afterwards)
    blocks, faulted = [], 0
    try:
        while faulted < grow and len(blocks) * RESERVE_PIECE < resident:
            block = libc.malloc(RESERVE_PIECE)
            if not block:
                break
            blocks.append(block)
            ctypes.memset(block, 0, RESERVE_PIECE)
            faulted = process.memory_info().rss - (resident - grow)
    finally:
        for block in reversed(blocks):
            libc.free(block)
    return max(0, faulted)


def give_back() -> None:
    """Return the heap's free pages to the system (after a job, before measuring memory)."""
    mallctl = _jemalloc()
    if mallctl is not None:
        mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0)
        return
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def no_collections():
    """The cyclic collector paused for the block (an import): importing what a train job needs
    (torch, numpy, scipy) ran 332 collections, some of them full ones over the growing set of
    module objects it made, 0.21-0.23 CPU s of the import's 1.7-1.9 here. An import leaves
    little in reference cycles; the collector runs again as before after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_imports() -> None:
    """Set what is alive now out of the cyclic collector's walks (gc.freeze), after a
    collection: call it once the modules a process needs are imported. An agent that has
    imported torch holds about 188,000 objects that live as long as it does, and `release`'s
    full collection walked every one of them: 0.1-0.15 CPU s each time, several times a job
    (each run's start and end, each memory reading of a profile), a tenth of a 4-device job's
    CPU on each agent. What the jobs create afterwards is collected as before; an object frozen
    now that later falls into a reference cycle is never freed, so freeze only what the process
    keeps."""
    gc.collect()
    gc.freeze()


def release() -> None:
    """Collect what ended work left in reference cycles (torch modules, autograd graphs) and
    return the heap's free pages to the system: a process's memory then follows what it
    holds now, not the largest it ever held."""
    gc.collect()
    give_back()
