"""What this device has to offer: usable cores and memory, honouring cgroup limits, and the
memory it can spare for a plan beside everything else that runs there."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SYS_CGROUP = Path("/sys/fs/cgroup")
SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}  # binary: M is MiB


def parse_size(text: str) -> int | None:
    """Bytes of a size as flags and settings give it: '300M', '1G', '1.5GiB', '512MB' (units
    are binary: M is MiB), '0' or a plain number of bytes; None for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2)]) if match else None


def _cgroup_paths(text: str | None = None) -> tuple[str | None, dict[str, str]]:
    """(v2 path, {v1 controller: path}) of this process's cgroups (from `text`, the form of
    /proc/self/cgroup, when given)."""
    v2, v1 = None, {}
    try:
        if text is None:
            text = Path("/proc/self/cgroup").read_text()
        for line in text.splitlines():
            hier, controllers, path = line.split(":", 2)
            if hier == "0" and controllers == "":
                v2 = path
            for c in controllers.split(","):
                if c:
                    v1[c] = path
    except OSError:
        pass
    return v2, v1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota() -> float | None:
    """CPU limit in cores from the cgroup (v2 cpu.max or v1 cfs quota), or None."""
    v2, v1 = _cgroup_paths()
    candidates = []
    if v2 is not None:
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            candidates.append(("v2", root / v2.lstrip("/") / "cpu.max"))
    if "cpu" in v1:
        for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
            candidates.append(("v1", root / v1["cpu"].lstrip("/")))
    for kind, path in candidates:
        if kind == "v2":
            text = _read(path)
            if text:
                quota, _, period = text.partition(" ")
                if quota != "max" and period:
                    return int(quota) / int(period)
        else:
            quota, period = _read(path / "cpu.cfs_quota_us"), _read(path / "cpu.cfs_period_us")
            if quota and period and int(quota) > 0:
                return int(quota) / int(period)
    return None


def usable_cores() -> int:
    """Whole cores this process may use (CPU affinity, capped by a cgroup quota, at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota + 0.5)))
    return max(1, cores)


def compute_threads() -> int:
    """Threads a compute of this process uses when not told: its usable cores, or fewer where
    the environment sets OMP_NUM_THREADS, the usual way to keep a program's threads down on a
    shared machine (torch's own default honours it; swarm would otherwise override it). Two
    processes computing on two threads each on two busy cores wait on each other's threads: a
    local run of yolov2-16 at 128 beside one busy process took 31-32 CPU-s on two threads and
    12-16 on one (libgomp's default spin) (bench/RESULTS.md, 2026-11-30 "the suite's CPU")."""
    cores = usable_cores()
    try:
        asked = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return cores
    return min(cores, asked) if asked > 0 else cores


# Limits at or above this are "unlimited" (cgroup v1 writes the largest page-aligned number).
UNLIMITED = 1 << 60


def cgroup_levels(proc_cgroup: str | None = None, root: Path = SYS_CGROUP) -> list[tuple[int, int, int | None]]:
    """(limit, high, in use) of each cgroup holding this process that limits its memory: its
    own and its parents' (cgroup v2 memory.max, memory.high and memory.current, else v1
    memory.limit_in_bytes and memory.usage_in_bytes). `high` is where the kernel starts to
    throttle and reclaim (v2 memory.high, as systemd's MemoryHigh= sets it; the limit where
    there is none). In use leaves out the cgroup's page cache (memory.stat's active and
    inactive file pages), which the kernel reclaims before it runs out, as MemAvailable does
    for the whole system; None where the use cannot be read. `proc_cgroup` (the text of
    /proc/self/cgroup) and `root` are for tests."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    levels = []
    if v2 is not None:
        for base in (root, root / "unified"):
            levels += _limited(base, v2, ("memory.max", "memory.high"), "memory.current",
                               ("active_file", "inactive_file"))
    if not levels and "memory" in v1:
        levels += _limited(root / "memory", v1["memory"], ("memory.limit_in_bytes",), "memory.usage_in_bytes",
                           ("total_active_file", "total_inactive_file"))
    return levels


def _limited(base: Path, path: str, limit_files: tuple[str, ...], usage_file: str, cache_keys: tuple[str, ...]
             ) -> list:
    """(limit, high, use less page cache) of `path` and each of its parents under `base` that
    limits memory (the first of `limit_files` is the hard limit, the second the throttle)."""
    out = []
    here = base / path.strip("/")
    while True:
        limits = [_number(_read(here / name)) for name in limit_files]
        limits = [n if n is not None and n < UNLIMITED else None for n in limits]
        if any(n is not None for n in limits):
            usage = _number(_read(here / usage_file))
            if usage is not None:
                stat = _stat(here / "memory.stat")
                usage -= min(usage, sum(stat.get(k, 0) for k in cache_keys))
            hard = limits[0] if limits[0] is not None else UNLIMITED
            out.append((hard, min(n for n in limits if n is not None), usage))
        if here == base or base not in here.parents:
            return out
        here = here.parent


def _number(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:  # "max"
        return None


def _stat(path: Path) -> dict[str, int]:
    """memory.stat as {key: value}."""
    out = {}
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        number = _number(value)
        if number is not None:
            out[name] = number
    return out


def cgroup_memory(proc_cgroup: str | None = None, root: Path = SYS_CGROUP) -> tuple[int | None, int] | None:
    """(limit, room) of this process's cgroups: the tightest hard limit (None where only a
    throttle is set), and the least a limited cgroup leaves below its throttle (or limit)
    beside what it uses; None when no cgroup limits memory."""
    levels = cgroup_levels(proc_cgroup, root)
    if not levels:
        return None
    hard = min(limit for limit, _, _ in levels)
    return (hard if hard < UNLIMITED else None), min(high - (used or 0) for _, high, used in levels)


def memory_limit() -> int | None:
    """Memory limit in bytes from the cgroup (the tightest of this process's cgroup and its
    parents'), or None when unlimited."""
    found = cgroup_memory()
    return found[0] if found else None


def usable_memory() -> int:
    """Total memory this process may use: physical memory, capped by a cgroup limit."""
    import psutil

    total = psutil.virtual_memory().total
    limit = memory_limit()
    return min(total, limit) if limit else total


# -- what a device can spare ------------------------------------------------------------
#
# A plan is fitted to what a device can spare when it is made, not to all of its memory:
# other programs (a Pi's desktop, a camera service) hold their part, and a plan that counts
# on it gets the agent killed by the kernel. What can be spared is
#
#     spare = min(available + own, total) - reserve
#
# available: the kernel's MemAvailable (free memory plus the page cache and slabs it can
#            reclaim) and, under a cgroup limit, the limit less what the cgroup uses beyond
#            its page cache: the smaller of the two;
# own:       the agent's private resident memory (its resident size less the file pages
#            it shares with the page cache, counted as available already): the agent is
#            the process that will use the room, so what it holds now is room for it;
# reserve:   a margin the user sets (`swarm join --reserve SIZE`), by default
#            default_reserve(total).
#
# The agent's code (torch's libraries) is page cache here, available; the planner takes it
# back with the runtime's resident size (the profile's runtime_bytes).

RESERVE_SHARE = 1 / 32           # of the device's memory, kept back by default ...
RESERVE_FLOOR = 32 * 2**20       # ... but at least this much
RESERVE_CEILING = 2**30          # ... and at most this much


def default_reserve(total: int) -> int:
    """The margin kept back when the user sets none: RESERVE_SHARE of the device's memory,
    within RESERVE_FLOOR and RESERVE_CEILING (32 MiB on a 1 GiB Pi, 128 MiB on 4 GiB).

    MemAvailable and a cgroup's use already leave out what the other programs hold and the
    kernel's own watermarks. The margin is for what they do not see: the
    programs' code and the data a run reads stay in the page cache that MemAvailable counts
    as free (evicted, they are read again and again: the device thrashes before any process
    is killed), and what other programs take after the plan is made. On the testbed, where
    a device's cgroup runs its agent alone, 32 MiB leaves every 1 GiB device the 4-sample
    micro-batch share its benchmarks plan (683 MiB, against 707 of a 739 MiB budget)."""
    return int(min(RESERVE_CEILING, max(RESERVE_FLOOR, total * RESERVE_SHARE)))


def spare_memory_of(total: int, available: int, own: int, reserve: int) -> int:
    """Bytes a plan may count on (the arithmetic above): what is available (at most the
    total) and what the agent holds, less the reserve; never below 0 or above the total less
    the reserve."""
    return max(0, min(total, available + own) - reserve)


@dataclass(frozen=True)
class MemoryFigures:
    """This device's memory as a plan sees it (bytes)."""
    total: int      # physical memory, capped by a cgroup limit
    available: int  # MemAvailable, and under a cgroup limit the limit less its use beyond page cache: the smaller
    own: int        # this process's private resident memory
    reserve: int    # kept back for the rest of the device

    @property
    def spare(self) -> int:
        return spare_memory_of(self.total, self.available, self.own, self.reserve)


def memory_figures(reserve: int | None = None, total: int | None = None) -> MemoryFigures:
    """This device's memory now, with `reserve` (None: default_reserve) kept back; `total`
    overrides the device's memory (an agent told what it has)."""
    import psutil

    total = usable_memory() if total is None else total
    available = psutil.virtual_memory().available
    cgroup = cgroup_memory()
    if cgroup is not None:
        available = min(available, max(0, cgroup[1]))
    return MemoryFigures(total, available, own_memory(), default_reserve(total) if reserve is None else reserve)


def spare_memory(reserve: int | None = None) -> int:
    """What this device can spare now for a plan (memory_figures(reserve).spare)."""
    return memory_figures(reserve).spare


def own_memory() -> int:
    """This process's private resident memory: resident, less the file pages it shares with the
    page cache (which MemAvailable counts as available already)."""
    import psutil

    info = psutil.Process().memory_info()
    return max(0, info.rss - getattr(info, "shared", 0))
