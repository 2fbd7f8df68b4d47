"""The systemd files of the swarm service: the unit, the GPU drop-in, the sysusers line (text only, no I/O)."""
from __future__ import annotations

UNIT_NAME = "swarm.service"
UNIT_DIR = "/etc/systemd/system"
CONFIG_PATH = "/etc/swarm/swarm.toml"
SYSUSERS_PATH = "/etc/sysusers.d/swarm.conf"
STATE_DIR = "/var/lib/swarm"           # StateDirectory=swarm
DEFAULT_USER = "swarm"                 # a system user made by systemd-sysusers
GPU_DROPIN = "gpu.conf"                # in swarm.service.d/
GPU_GROUPS = ("video", "render")       # owners of /dev/nvhost-*, /dev/nvmap, /dev/dri/renderD*
WATCHDOG_SEC = 30
DEFAULT_EXEC = ("/opt/swarm/venv/bin/swarm",)   # where deploy/install.sh puts it
MiB, GiB = 1 << 20, 1 << 30

# Resource limits (systemd's defaults are 1024 descriptors and no memory limit).
# Descriptors: one per connection, and an agent talks to a coordinator and, in a job, to other
# agents (at most one connection each way per device: ~2,000 for a swarm of 1,000 devices);
# torch adds its libraries, data files and shared-memory segments (a few hundred), trio and
# zeroconf a few. 16384 is eight times that, and still bounds what idle sockets can cost
# (~10 KiB each, kernel and Python: 160 MiB). Nothing in the agent uses select(), the reason
# for systemd's soft limit of 1024.
OPEN_FILES = 16384
# Threads: trio's worker threads (at most 40 at a time under its default limiter, plus the
# one compute thread), torch's intra-op and inter-op pools (a thread per core each: 8 on a
# Pi, 24 on a 12-core Orin, 128 on a 64-core PC) and a handful for the event loop, zeroconf
# and CUDA: under 200 on any device. 512 is room to spare and still stops a thread leak long
# before the system's own limit.
TASKS = 512
# Memory: MemoryMax = total - max(OS_RESERVE, total / OS_RESERVE_DIVISOR), at least half the
# total, rounded down to MEMORY_STEP (so MemTotal moving by some KiB after a kernel update
# seldom changes the unit). The reserve keeps the system (sshd, journald, the network, the
# page cache of its own files) alive when the agent outgrows its share: the agent is killed
# and restarted, not the device. MemoryHigh sits 1/16 below: above it the kernel reclaims the
# agent's page cache (torch's libraries, checkpoints being written) and slows its
# allocations, so it meets the hard limit later or not at all.
OS_RESERVE = 256 * MiB                 # Raspberry Pi OS Lite uses ~100 MiB idle
OS_RESERVE_DIVISOR = 8                 # 1/8: ~1 GiB of an 8 GiB Jetson, whose desktop needs it
MEMORY_STEP = 16 * MiB
REFERENCE_MEMORY = 4 * GiB             # deploy/swarm.service is the unit of a 4 GiB device

UNIT = """\
# The swarm agent (`swarm join`) as a system service. Written by `swarm service install`,
# which rewrites it: put local changes in a drop-in (`sudo systemctl edit swarm`).
[Unit]
Description=swarm agent: offers this device to the swarm
Wants=network-online.target
After=network-online.target
# after 20 failed starts within 15 minutes, stop trying (see `systemctl status swarm`)
StartLimitIntervalSec=15min
StartLimitBurst=20

[Service]
# READY=1 comes once the agent listens and is advertised on mDNS; WATCHDOG=1 comes from
# its event loop every WatchdogSec/2, so a stuck agent is killed and restarted.
Type=notify
ExecStart={exec_start}
User={user}
WatchdogSec={watchdog}s
Restart=on-failure
RestartSec=10s
TimeoutStartSec=2min
TimeoutStopSec=30s
# node id, token, profiles and checkpoints: the only place the agent may write
StateDirectory=swarm
StateDirectoryMode=0700
CacheDirectory=swarm
CacheDirectoryMode=0700
Environment=XDG_CACHE_HOME=%C/swarm CUDA_CACHE_PATH=%C/swarm/cuda
UMask=0077

# Resource limits, for this device's {memory_total} of memory: the system keeps the larger of
# 256 MiB and 1/8 of it; above MemoryHigh (1/16 below MemoryMax) the kernel reclaims the
# agent's page cache and slows it, at MemoryMax the agent is killed and restarted. Descriptors
# for thousands of connections plus torch's files; threads for trio's workers and torch's
# pools with room to spare. (`swarm service install --memory SIZE` for another device.)
MemoryHigh={memory_high}
MemoryMax={memory_max}
LimitNOFILE={open_files}
TasksMax={tasks}

# Hardening (`systemd-analyze security swarm` rates it 1.4; 1.7 with the GPU drop-in).
# Not set, on purpose: MemoryDenyWriteExecute (torch's CPU kernels and CUDA compile code
# at run time), ProcSubset=pid (the agent reads /proc/meminfo and /proc/cpuinfo),
# PrivateNetwork and IPAddressDeny (it talks to the LAN, whatever its addresses).
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
PrivateMounts=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
# IPv4/IPv6 for peers and mDNS, unix for systemd's notify socket, netlink to list interfaces
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RemoveIPC=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM

[Install]
WantedBy=multi-user.target
"""

GPU = """\
# GPU access for the swarm agent (a Jetson's CUDA device, or another NVIDIA GPU). Written by
# `swarm service install` where it finds one (--gpu yes|no to choose).
[Service]
# the base unit hides /dev behind PrivateDevices=yes; CUDA needs the real device nodes:
# /dev/nvhost-* and /dev/nvmap (and /dev/nvgpu/) on a Jetson, /dev/nvidia* elsewhere,
# /dev/dri/renderD* for render nodes. Access is still by their permissions: on a Jetson
# they belong to the groups below, which the service user joins here.
PrivateDevices=no
{groups}"""

SYSUSERS = """\
# The system user of the swarm service (systemd-sysusers creates it; written by `swarm service install`).
u {user} - "swarm agent" {state}
"""


def unit_quote(word: str) -> str:
    """One ExecStart word: quoted if it has spaces or quotes, '%' doubled for systemd's specifiers."""
    word = word.replace("%", "%%")
    if word and not any(c in word for c in " \t\"'\\"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def memory_limits(total: int) -> tuple[int, int]:
    """(MemoryHigh, MemoryMax) in bytes for a device with `total` bytes of memory.

    >>> [n // MiB for n in memory_limits(906 * MiB)]      # a 1 GiB Raspberry Pi 3
    [600, 640]
    """
    reserve = max(OS_RESERVE, total // OS_RESERVE_DIVISOR)
    most = max(total - reserve, total // 2) // MEMORY_STEP * MEMORY_STEP
    return most - most // 16, most


def size_text(n: int) -> str:
    """Bytes as a person reads them: '906 MiB', '7.4 GiB'."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n // MiB} MiB"


def unit_size(n: int) -> str:
    """Bytes as a systemd setting: whole MiB ('640M')."""
    return f"{n // MiB}M"


def unit_text(command: tuple[str, ...] | list[str] = DEFAULT_EXEC, user: str = DEFAULT_USER,
              config: str = CONFIG_PATH, *, memory: int) -> str:
    """The unit running `command join --config CONFIG` as `user`, its memory limits made for
    a device with `memory` bytes (MemTotal)."""
    exec_start = " ".join(unit_quote(w) for w in [*command, "join", "--config", config])
    high, most = memory_limits(memory)
    return UNIT.format(exec_start=exec_start, user=user, watchdog=WATCHDOG_SEC, memory_total=size_text(memory),
                       memory_high=unit_size(high), memory_max=unit_size(most), open_files=OPEN_FILES,
                       tasks=TASKS)


def gpu_dropin_text(groups: tuple[str, ...] | list[str]) -> str:
    line = f"SupplementaryGroups={' '.join(groups)}\n" if groups else "# (no video or render group on this system)\n"
    return GPU.format(groups=line)


def sysusers_text(user: str = DEFAULT_USER) -> str:
    return SYSUSERS.format(user=user, state=STATE_DIR)
