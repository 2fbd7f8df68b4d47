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


def unit_text(command: tuple[str, ...] | list[str] = DEFAULT_EXEC, user: str = DEFAULT_USER,
              config: str = CONFIG_PATH) -> str:
    """The unit running `command join --config CONFIG` as `user`."""
    exec_start = " ".join(unit_quote(w) for w in [*command, "join", "--config", config])
    return UNIT.format(exec_start=exec_start, user=user, watchdog=WATCHDOG_SEC)


def gpu_dropin_text(groups: tuple[str, ...] | list[str]) -> str:
    line = f"SupplementaryGroups={' '.join(groups)}\n" if groups else "# (no video or render group on this system)\n"
    return GPU.format(groups=line)


def sysusers_text(user: str = DEFAULT_USER) -> str:
    return SYSUSERS.format(user=user, state=STATE_DIR)
