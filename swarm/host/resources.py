"""What this device has to offer: usable cores and memory, honouring cgroup limits."""
from __future__ import annotations

import os
from pathlib import Path


def _cgroup_paths() -> tuple[str | None, dict[str, str]]:
    """(v2 path, {v1 controller: path}) of this process's cgroups."""
    v2, v1 = None, {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
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


def memory_limit() -> int | None:
    """Memory limit in bytes from the cgroup, or None when unlimited."""
    v2, v1 = _cgroup_paths()
    if v2 is not None:
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            text = _read(root / v2.lstrip("/") / "memory.max")
            if text and text != "max":
                return int(text)
    if "memory" in v1:
        text = _read(Path("/sys/fs/cgroup/memory") / v1["memory"].lstrip("/") / "memory.limit_in_bytes")
        if text and int(text) < (1 << 60):
            return int(text)
    return None


def usable_memory() -> int:
    """Total memory this process may use: physical memory, capped by a cgroup limit."""
    import psutil

    total = psutil.virtual_memory().total
    limit = memory_limit()
    return min(total, limit) if limit else total
