"""Names and addresses of everything the testbed makes, all under one distinctive prefix.

`swarm testbed down` removes exactly the things whose names start with PREFIX.
"""
from __future__ import annotations

import os
from pathlib import Path

PREFIX = "swtb"
BRIDGE = f"{PREFIX}-br0"
CGROUP_GROUP = PREFIX
SUBNET = "10.213.77"              # /24 on the bridge
HOST_ADDRESS = f"{SUBNET}.1"
DEVICE_INTERFACE = "swarm0"       # the device's end of its link, inside its namespace
AGENT_PORT = 4750
MAX_DEVICES = 200


def device_name(k: int) -> str:
    return f"dev{k}"


def namespace(device: str) -> str:
    return f"{PREFIX}-{device}"


def host_link(device: str) -> str:
    return f"{PREFIX}-{device.removeprefix('dev')}"   # e.g. swtb-3 (interface names: 15 characters at most)


def device_address(k: int) -> str:
    return f"{SUBNET}.{10 + k}"


def state_dir() -> Path:
    """Where the testbed keeps its token, logs and record of what it made."""
    if os.environ.get("SWARM_TESTBED_DIR"):
        return Path(os.environ["SWARM_TESTBED_DIR"])
    if os.geteuid() == 0:
        return Path("/run/swarm-testbed")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "swarm-testbed" if runtime else Path(f"/tmp/swarm-testbed-{os.getuid()}")
