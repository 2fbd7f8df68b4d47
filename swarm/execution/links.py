"""A train run's own connections to the other devices of its epoch.

Each run (one device, one epoch) opens a connection of its own to each device it sends to,
on first use, sends that device's messages on it and nothing else, and closes it when the
run ends. So a run never inherits a connection of an older epoch: a device that was cut off
and comes back, whose old connections may have been closed at the other end while it could
not hear, starts from clean ones, and so do its peers.

A link that breaks while the run goes on (a send fails, a connection cannot be made, or one
of ours is closed by anything but us) may have lost messages the schedule waits for: the run
reports it to the coordinator, ("link", device, far end) {"reason"}, which handles it as the
loss of the far end, and drops what it would send there until the re-plan cancels the run.
Messages to the coordinator go over the agent's connection to it; if that breaks, the
coordinator sees it itself (RosterControl), and they are dropped too.

Small messages take a second connection to the same device (the quick lane): a connection
sends one whole message at a time, and a gradient bucket's share or a stage's activations
take a quarter of a second on a 100 Mbit/s link, which a group's BatchNorm statistics, a
halo or a running-statistics merge would otherwise wait out behind them, and with them the
compute that waits for the answer. Messages are keyed, so their order between the two
connections does not matter.

In a plan of one replicated stage whose replicas each hold whole micro-batches (dp or
single, no group BatchNorm, no tiles), nothing small waits on the compute, and the quick lane
takes the gradient shares of small buckets too (quick_limit): with eight devices the front
layers' bucket (layers 0-6 of yolov2-16, 0.7 MB) travels in 88 kB shares, and the next
forward waits for its sum first, which on the bulk connection would queue in the kernel's
send buffer behind the back layers' megabytes. Where a group's BatchNorm exchanges or tiles'
halos use the quick lane, the compute waits on each of those, dozens of times a step, and
the shares would hold them up (measured: batch 32 in pairs, 12% slower).

On each connection the message that goes next is the waiting one with the lowest priority
(first come, first served among equals). A gradient share waits behind anything else, and
the shares of the front layers' buckets go before those of the back layers': the next
step's forward needs the front layers' updates first, and their bucket is the last the
backward finishes, so in arrival order it would queue behind the back layers' larger shares.
"""
from __future__ import annotations

import heapq
import logging
from typing import Awaitable, Callable

import trio

from swarm.errors import SwarmError
from swarm.net import ConnectionLost, PeerConnection, PeerUnavailable

log = logging.getLogger("swarm.execution")

LINK_ERRORS = (ConnectionLost, SwarmError, OSError)  # a send or a connection attempt that failed
QUICK_BYTES = 64 * 1024  # a message with fewer tensor bytes than this takes the quick lane
QUICK_SHARES_BYTES = 128 * 1024  # the same where nothing small waits on the compute (quick_limit)
WATCH_S = 0.2  # how often the run looks for connections of its own that were closed


def quick_limit(plan) -> int:
    """Below how many tensor bytes a message of `plan`'s runs takes the quick lane: more where
    the plan is one stage of replicas that each compute whole micro-batches, whose compute
    waits on no small message (no group BatchNorm, no halos)."""
    if len(plan.stages) != 1:
        return QUICK_BYTES
    stage = plan.stages[0]
    whole = stage.mode == "single" or (stage.mode == "dp" and set(stage.group_sizes()) == {1})
    return QUICK_SHARES_BYTES if whole else QUICK_BYTES


class Turns:
    """Whose message a connection sends next: of those waiting, the lowest priority, then
    the earliest. (A trio.Lock hands over first come, first served.)"""

    def __init__(self) -> None:
        self.busy = False
        self.waiting: list[tuple] = []  # heap of (priority, arrival, event)
        self.arrivals = 0

    async def acquire(self, priority) -> None:
        if not self.busy:
            await trio.lowlevel.checkpoint_if_cancelled()  # (raises before the turn is taken, never after)
            self.busy = True
            return
        entry = (priority, self.arrivals, trio.Event())
        self.arrivals += 1
        heapq.heappush(self.waiting, entry)
        try:
            await entry[2].wait()
        except BaseException:
            if entry[2].is_set():  # handed the turn as it was cancelled: pass it on
                self.release()
            else:
                self.waiting.remove(entry)
                heapq.heapify(self.waiting)
            raise

    def release(self) -> None:
        if self.waiting:
            heapq.heappop(self.waiting)[2].set()  # the turn passes straight to it: still busy
        else:
            self.busy = False


class RunLinks:
    """`devices`: name -> {"node_id", "address"} of the epoch's devices. `connect(address)`
    opens a new connection (JobContext.connect without a node id never reuses one);
    `report(name, why)` tells the coordinator that the link to `name` broke."""

    def __init__(self, devices: dict[str, dict], connect: Callable[[str], Awaitable[PeerConnection]],
                 report: Callable[[str, str], Awaitable[None]]):
        self.devices = devices
        self._connect = connect
        self._report = report
        self.conns: dict[tuple[str, bool], PeerConnection] = {}  # (name, quick lane) -> ours
        self.broken: dict[str, str] = {}  # name -> why its link broke
        self._locks: dict[tuple[str, bool], trio.Lock] = {}
        self._turns: dict[tuple[str, bool], Turns] = {}
        self._closing = False

    async def send(self, name: str, message, quick: bool = False, priority=()) -> None:
        """Send on our connection to `name` (made on first use), or on our quick lane to it,
        after the waiting messages of lower `priority` (any comparable value; () goes
        first); a failure is reported, once, and the message dropped."""
        if name in self.broken:
            return
        lane = (name, quick)
        turns = self._turns.setdefault(lane, Turns())
        await turns.acquire(priority)
        try:
            conn = await self._conn(lane)
            await conn.send(message)
        except LINK_ERRORS as exc:
            await self._broke(name, f"{type(exc).__name__}: {exc}")
        finally:
            turns.release()

    async def open_to(self, names) -> None:
        """Open both lanes to each of `names` now, all at once, rather than at the first send:
        the run's first sums then do not wait for handshakes. A connection that cannot be
        made is reported as a send's would be."""
        async def one(lane: tuple[str, bool]) -> None:
            if lane[0] in self.broken:
                return
            try:
                await self._conn(lane)
            except LINK_ERRORS as exc:
                await self._broke(lane[0], f"{type(exc).__name__}: {exc}")

        async with trio.open_nursery() as nursery:
            for name in names:
                for quick in (False, True):
                    nursery.start_soon(one, (name, quick))

    async def _conn(self, lane: tuple[str, bool]) -> PeerConnection:
        conn = self.conns.get(lane)
        if conn is not None:
            return conn
        name = lane[0]
        async with self._locks.setdefault(lane, trio.Lock()):
            if lane not in self.conns:
                device = self.devices[name]
                conn = await self._connect(device["address"])
                if conn.peer_id != device["node_id"]:
                    await conn.aclose("not the device the plan names")
                    raise PeerUnavailable(f"{device['address']} is node {conn.peer_id}, not {name} "
                                          f"(node {device['node_id']})")
                self.conns[lane] = conn
        return self.conns[lane]

    async def watch(self) -> None:
        """Report our connections that were closed under us (by the far end, or broken)."""
        while True:
            for (name, _), conn in list(self.conns.items()):
                if conn.closed and name not in self.broken and not self._closing:
                    await self._broke(name, f"the connection to {conn.address} closed")
            await trio.sleep(WATCH_S)

    async def _broke(self, name: str, why: str) -> None:
        if name in self.broken or self._closing:
            return
        self.broken[name] = why
        log.warning("link to %s broke (%s); telling the coordinator", name, why)
        await self._report(name, why)

    async def aclose(self) -> None:
        """Close every connection of ours (each says goodbye within a second, all at once)."""
        self._closing = True
        conns, self.conns = list(self.conns.values()), {}
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for conn in conns:
                    nursery.start_soon(conn.aclose, "the run ended")
