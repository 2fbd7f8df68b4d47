"""Which network swarm uses: --interface NAME|ADDRESS, else SWARM_INTERFACE, else the default route's."""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import SwarmError

ENV = "SWARM_INTERFACE"


@dataclass(frozen=True)
class NetworkChoice:
    """The interface discovery and connections use, and its IPv4 addresses.

    pinned: the user named it (flag or SWARM_INTERFACE). Then the agent listens only on
    these addresses and outgoing connections leave from the first one; mDNS always uses
    only these addresses, pinned or not.
    """
    interface: str
    addresses: tuple[str, ...]
    pinned: bool

    @property
    def address(self) -> str:
        return self.addresses[0]

    @property
    def listen_hosts(self) -> list[str]:
        return list(self.addresses) if self.pinned else ["0.0.0.0"]

    @property
    def source_address(self) -> str | None:
        return self.address if self.pinned else None


def _ipv4_by_interface() -> dict[str, list[str]]:
    import psutil

    found: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        found[name] = [a.address for a in addrs if a.family == socket.AF_INET]
    return found


def default_route_interface() -> str | None:
    """The interface of the IPv4 default route (Linux), or None."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            return fields[0]
    return None


def resolve_network(choice: str | None = None) -> NetworkChoice:
    """The network to use; SwarmError if the named interface or address does not exist here."""
    choice = choice or os.environ.get(ENV) or None
    interfaces = _ipv4_by_interface()
    if choice is None:
        name = default_route_interface()
        if name is None or not interfaces.get(name):
            up = [n for n, a in interfaces.items() if a and not all(x.startswith("127.") for x in a)]
            if not up:
                raise SwarmError("no network interface with an IPv4 address found; pass --interface "
                                 "(e.g. --interface lo to stay on this machine)")
            name = up[0]
        return NetworkChoice(name, tuple(interfaces[name]), pinned=False)
    try:
        ipaddress.IPv4Address(choice)
    except ValueError:
        pass
    else:
        for name, addrs in interfaces.items():
            if choice in addrs:
                return NetworkChoice(name, (choice,), pinned=True)
        raise SwarmError(f"no interface of this machine has the address {choice} "
                         f"(addresses here: {', '.join(a for v in interfaces.values() for a in v) or 'none'})")
    if choice not in interfaces:
        raise SwarmError(f"no network interface named '{choice}' (interfaces here: {', '.join(sorted(interfaces))})")
    if not interfaces[choice]:
        raise SwarmError(f"interface '{choice}' has no IPv4 address")
    return NetworkChoice(choice, tuple(interfaces[choice]), pinned=True)


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """'host:port' or 'host' -> (host, port); SwarmError if malformed."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), str(default_port)
    if not host:
        raise SwarmError(f"peer '{text}' has no host (expected host:port)")
    try:
        number = int(port)
    except ValueError:
        raise SwarmError(f"peer '{text}' has a port that is not a number (expected host:port)") from None
    if not 0 < number < 65536:
        raise SwarmError(f"peer '{text}' has port {number}, outside 1-65535")
    return host, number


def parse_peers(text: str | None, default_port: int) -> list[tuple[str, int]]:
    """'h1:p1,h2:p2' -> [(h1, p1), (h2, p2)] (empty for None or '')."""
    return [parse_endpoint(part, default_port) for part in (text or "").split(",") if part.strip()]
