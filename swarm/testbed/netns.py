"""The ip and tc commands the testbed runs: namespaces, the bridge, veth links, bandwidth caps."""
from __future__ import annotations

import re
import shutil
import subprocess

from swarm.errors import SwarmError
from swarm.testbed.names import PREFIX

LINK_QUEUE_S = 0.1   # what a capped link's queue holds, in seconds of its rate (tc tbf's latency before)
LINK_BURST = "64kb"  # what the cap lets through at once
ACK_SHARE = 0.02     # the rate pure acknowledgements are sure of (they may take the whole link's)
RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
              "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}  # tc's rate units, in bytes per second


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


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate ("100mbit": 12.5e6)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate.lower())
    if match is None or match.group(2) not in RATE_UNITS:
        raise SwarmError(f"'{rate}' is not a rate tc understands (e.g. 100mbit, 20mbit, 1gbit)")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def cap_bandwidth(rate: str, device: str, namespace: str | None = None) -> None:
    """Cap `device`'s outgoing traffic at `rate` (tc htb), pure TCP acknowledgements first.

    Data waits behind the cap in one queue of LINK_QUEUE_S at the rate; an IP packet of TCP
    under 128 bytes (an acknowledgement without data) goes before it. With one queue for
    everything (tc tbf, the testbed's cap until 2026-12), a device that sends and receives at
    once, as every member of a gradient sum does, held the acknowledgements of what it
    received behind its own outgoing data, and the download cap held those to it behind
    everyone's data to it. TCP, clocked by late acknowledgements, then sent packets of one or
    two segments instead of 15-30 kB, and each crossed the bridge and both caps on its own,
    in softirqs charged to whichever device was on the CPU. Eight 0.2-core devices streaming
    100 MB each to the next at once (bench/link_packets.py): 2.3 kB a packet and 1.6-2.8 s of
    softirq with one queue (bbr; cubic 1.1 kB and 8.5-9.4 s), 22-32 kB and under 1 s with
    this; a ring all-reduce of 13.75 MB over them cost each device 0.118 CPU-s against 0.024
    (bench/RESULTS.md, 2026-12-01). A device on a LAN does not pay that: its NIC's queue
    (fq_codel, systemd's default) sends a flow's few packets before another's backlog, a
    switch port holds a few milliseconds, and the NIC segments and coalesces in hardware."""
    tc = ["ip", "netns", "exec", namespace, "tc"] if namespace else ["tc"]
    per_s = rate_bytes(rate)
    bps = per_s * 8
    run(*tc, "qdisc", "replace", "dev", device, "root", "handle", "1:", "htb", "default", "20")
    cap = ["burst", LINK_BURST, "cburst", LINK_BURST]
    run(*tc, "class", "add", "dev", device, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate, *cap)
    for classid, share, prio in (("1:10", ACK_SHARE, "0"), ("1:20", 1 - ACK_SHARE, "1")):
        run(*tc, "class", "add", "dev", device, "parent", "1:1", "classid", classid, "htb", "rate",
            f"{max(1, int(bps * share))}bit", "ceil", rate, "prio", prio, "quantum", "65536", *cap)
    run(*tc, "qdisc", "add", "dev", device, "parent", "1:20", "handle", "20:", "bfifo", "limit",
        str(int(per_s * LINK_QUEUE_S) + 65536))
    run(*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
        "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10")


def in_namespace(name: str) -> list[str]:
    """Command prefix entering only the network namespace (the mount namespace stays, so
    cgroup files remain visible to the device)."""
    return ["nsenter", f"--net=/run/netns/{name}", "--"]
