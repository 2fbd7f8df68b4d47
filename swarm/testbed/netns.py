"""The ip and tc commands the testbed runs: namespaces, the bridge, veth links, bandwidth caps."""
from __future__ import annotations

import shutil
import subprocess

from swarm.errors import SwarmError
from swarm.testbed.names import PREFIX


def need_tools() -> None:
    missing = [t for t in ("ip", "tc", "nsenter") if shutil.which(t) is None]
    if missing:
        raise SwarmError(f"the namespace testbed needs {', '.join(missing)} (iproute2 and util-linux); install "
                         f"them, or use --loopback")


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one command; SwarmError with its own message if it fails and `check`."""
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise SwarmError(f"`{' '.join(args)}` failed: {(result.stderr or result.stdout).strip()}")
    return result


def namespaces() -> list[str]:
    """Our namespaces (names starting with the prefix)."""
    out = run("ip", "netns", "list", check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(PREFIX + "-"))


def links() -> list[str]:
    """Our interfaces in the host namespace (bridge and host ends of the device links)."""
    out = run("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX + "-"):
                names.append(name)
    return names


def namespace_pids(name: str) -> list[int]:
    out = run("ip", "netns", "pids", name, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def link_is_up(name: str) -> bool:
    out = run("ip", "-o", "link", "show", name, check=False).stdout
    flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
    return "UP" in flags


def cap_bandwidth(rate: str, device: str, namespace: str | None = None) -> None:
    """Token-bucket limit on `device`'s outgoing traffic (tc tbf)."""
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    run(*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate, "burst", "64kb",
        "latency", "100ms")


def in_namespace(name: str) -> list[str]:
    """Command prefix entering only the network namespace (the mount namespace stays, so
    cgroup files remain visible to the device)."""
    return ["nsenter", f"--net=/run/netns/{name}", "--"]
