"""How workers and the coordinator talk: keyed messages into the receiver's mailbox.

A message is (key, payload): the key is a tuple of strings and integers naming what it is
(`("act", step, stage, part, microbatch, tensor, src_part)`); the payload is a dict of
plain values whose "arrays" entry, if any, is a list of tensors. The in-process network
below hands tensors over in memory (copying between devices, sharing within one); the
network endpoint turns them into numpy frames on the wire.
"""
from __future__ import annotations

from typing import Any, Protocol

import trio

from swarm.execution.mailbox import Mailbox


class Endpoint(Protocol):
    name: str
    mailbox: Mailbox

    async def send(self, dst: str, key: tuple, payload: dict[str, Any]) -> None: ...


class LocalNetwork:
    """Several endpoints in one process (tests, and a device hosting several stages)."""

    def __init__(self) -> None:
        self.endpoints: dict[str, LocalEndpoint] = {}
        self.bytes_sent = 0

    def endpoint(self, name: str) -> "LocalEndpoint":
        ep = LocalEndpoint(name, self)
        self.endpoints[name] = ep
        return ep

    def close(self, reason: BaseException) -> None:
        for ep in self.endpoints.values():
            ep.mailbox.close(reason)


class LocalEndpoint:
    def __init__(self, name: str, network: LocalNetwork):
        self.name = name
        self.network = network
        self.mailbox = Mailbox()

    async def send(self, dst: str, key: tuple, payload: dict[str, Any]) -> None:
        await trio.lowlevel.checkpoint()
        target = self.network.endpoints.get(dst)
        if target is None:
            raise ConnectionError(f"no device {dst}")
        arrays = payload.get("arrays")
        if arrays and dst != self.name:  # another device gets its own copy, as over a wire
            payload = dict(payload, arrays=[_copy(a) for a in arrays])
            self.network.bytes_sent += sum(_nbytes(a) for a in arrays)
        target.mailbox.put(key, payload)


def _copy(a):
    return a.clone() if hasattr(a, "clone") else a.copy()


def _nbytes(a) -> int:
    return a.numel() * a.element_size() if hasattr(a, "element_size") else a.nbytes
