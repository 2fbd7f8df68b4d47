"""What the coordinator side knows about each device: its advert, its answers, its health."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import trio


@dataclass
class Member:
    """One agent as seen from a coordinator.

    health: alive, suspect, dead, left (said goodbye), unreachable (never answered),
    refused (answered but failed the handshake: another token or protocol version).
    """
    node_id: str                     # "host:port" until a handshake tells the real id
    address: str
    port: int
    name: str = "?"
    cores: int = 0
    memory: int = 0                  # bytes: the device's (physical, or its cgroup's limit)
    spare: int | None = None         # bytes it could spare for a plan when it last said (None: not known)
    accelerator: str = "?"
    accelerator_memory: int = -1     # bytes of its own; 0: none (a CPU, or shared with the host); -1: not known
    version: str = "?"
    incarnation: str = ""            # the agent's start it last described (Info.incarnation)
    health: str = "unreachable"
    error: str = ""
    last_seen: float | None = None   # wall-clock time of the last sign of life
    rtt: float | None = None         # seconds, from the last Ping
    job_id: str | None = None
    job_state: str | None = None
    peers: list[str] = field(default_factory=list)
    source: str = "mdns"             # mdns or peers
    conn: object = field(default=None, repr=False)
    connected: trio.Event = field(default_factory=trio.Event, repr=False)

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.address, self.port

    def seen(self) -> None:
        self.last_seen = time.time()

    def as_dict(self) -> dict:
        """JSON-ready form, as `swarm status --json` prints it."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("conn", "connected")}
        data["peers"] = list(self.peers)
        data["last_seen_ago"] = None if self.last_seen is None else round(time.time() - self.last_seen, 3)
        return data
