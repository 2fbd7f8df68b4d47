"""CPU quota and memory limit for a testbed device, on cgroup v2 or v1 hosts, whichever works.

v2: <mount>/swtb/devK/{cpu.max, memory.max}, with +cpu +memory enabled down the tree.
v1: <cpu mount>/swtb/devK/cpu.cfs_quota_us and <memory mount>/swtb/devK/memory.limit_in_bytes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import SwarmError
from swarm.testbed.names import CGROUP_GROUP

# A short CFS period: a quarter-core device then runs 2.5 ms in every 10 ms, like a slow core,
# rather than 25 ms in every 100 ms, which would stall every exchange between devices for up
# to 75 ms whenever one of them has spent its share.
CPU_PERIOD_US = 10_000


@dataclass(frozen=True)
class CgroupHost:
    """Where this host's cgroup controllers are: a v2 mount, or v1 mounts per controller."""
    version: int                 # 2 or 1
    v2_mount: Path | None = None
    cpu_mount: Path | None = None
    memory_mount: Path | None = None

    def device_dirs(self, device: str) -> list[Path]:
        if self.version == 2:
            return [self.v2_mount / CGROUP_GROUP / device]
        return [self.cpu_mount / CGROUP_GROUP / device, self.memory_mount / CGROUP_GROUP / device]

    def group_dirs(self) -> list[Path]:
        if self.version == 2:
            return [self.v2_mount / CGROUP_GROUP]
        return [self.cpu_mount / CGROUP_GROUP, self.memory_mount / CGROUP_GROUP]


def detect(mounts_text: str | None = None) -> CgroupHost | None:
    """The usable cgroup layout from /proc/mounts: v2 if it has the cpu and memory
    controllers, else v1 if both are mounted; None if neither."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return None
    v2, cpu, memory = None, None, None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount, fstype, options = Path(fields[1]), fields[2], set(fields[3].split(","))
        if fstype == "cgroup2":
            try:
                controllers = set((mount / "cgroup.controllers").read_text().split())
            except OSError:
                controllers = set()
            if {"cpu", "memory"} <= controllers and v2 is None:
                v2 = mount
        elif fstype == "cgroup":
            if "cpu" in options and cpu is None:
                cpu = mount
            if "memory" in options and memory is None:
                memory = mount
    if v2 is not None:
        return CgroupHost(2, v2_mount=v2)
    if cpu is not None and memory is not None:
        return CgroupHost(1, cpu_mount=cpu, memory_mount=memory)
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise SwarmError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def create_limits(host: CgroupHost, device: str, cpu: float | None, memory: int | None) -> list[Path]:
    """Make the device's cgroup(s) with these limits (None: unlimited); the directories."""
    dirs = host.device_dirs(device)
    if host.version == 2:
        root, group = host.v2_mount, host.v2_mount / CGROUP_GROUP
        group.mkdir(exist_ok=True)
        for parent in (root, group):
            _write(parent / "cgroup.subtree_control", "+cpu +memory")
        dirs[0].mkdir(exist_ok=True)
        if cpu is not None:
            _write(dirs[0] / "cpu.max", f"{int(cpu * CPU_PERIOD_US)} {CPU_PERIOD_US}")
        if memory is not None:
            _write(dirs[0] / "memory.max", str(memory))
            if (dirs[0] / "memory.swap.max").exists():
                _write(dirs[0] / "memory.swap.max", "0")
        return dirs
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    cpu_dir, memory_dir = dirs
    if cpu is not None:
        _write(cpu_dir / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(cpu_dir / "cpu.cfs_quota_us", str(int(cpu * CPU_PERIOD_US)))
    if memory is not None:
        _write(memory_dir / "memory.limit_in_bytes", str(memory))
    return dirs


def add_process(dirs: list[Path], pid: int) -> None:
    for d in dirs:
        _write(d / "cgroup.procs", str(pid))


def processes(directory: Path) -> list[int]:
    try:
        return [int(x) for x in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove(directory: Path, wait: float = 3.0) -> bool:
    """rmdir a cgroup once its processes are gone (waits up to `wait` s); True if removed."""
    deadline = time.monotonic() + wait
    while True:
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
