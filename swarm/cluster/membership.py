"""Heartbeats and membership: who is alive, from heartbeats and probes (coordinator side), as
events in trio time. The agent sends the heartbeats (Agent._watch_heartbeats, at the interval
a watcher asks for in its Watch); the roster (roster.py) feeds what it hears into Membership.

    alive ──(nothing heard for suspect_after s, or its connection broke)──> suspect
    suspect ──(probe answered within probe_timeout)──> alive   "recovered"
    suspect ──(probe failed or timed out)──> dead
    dead ──(heard from again)──> alive                          "recovered"
    any ──remove()──> gone                                      "left"

Any sign of life counts as hearing from a member (a heartbeat, any bytes on its
connection), so a device busy streaming a large tensor is not taken for dead. The probe
is a function supplied by the owner (the Roster pings over the connection, or waits for
a reconnection); Membership only decides when to call it and what its answer means.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

Probe = Callable[[str], Awaitable[bool]]

ALIVE, SUSPECT, DEAD = "alive", "suspect", "dead"

# While devices run jobs (training, profiling): a device whose few tenths of a core are busy
# with the job may answer late; it has this long to be heard again, then this long to
# answer a probe. (A killed agent's connection breaks, which makes it suspect at once.)
BUSY_SUSPECT_AFTER, BUSY_PROBE_TIMEOUT = 2.0, 2.0
# A member whose message to us is still arriving answers a probe only after that message
# (one stream: its answer is queued behind it). A stage's weights at a checkpoint (150 MB
# for two layers of the full yolov2), sent by five devices at once into one 100 Mbit link,
# can stall a flow for seconds; so while its message is incomplete, a member is probed again
# until it has been this long without a byte, rather than given up after one probe. (A
# killed agent's connection breaks at once all the same.)
MESSAGE_GRACE = 30.0


@dataclass(frozen=True)
class MembershipEvent:
    """A change of a member's health. kind: joined, suspect, recovered, dead or left."""
    node_id: str
    kind: str
    time: float     # trio.current_time() when it happened
    reason: str = ""


class Liveness:
    """One watched node's health as Membership judges it: when it was last heard from, and when
    it turns suspect."""

    def __init__(self, node_id: str, now: float, suspect_after: float):
        self.node_id = node_id
        self.health = ALIVE
        self.last_heard = now
        self.deadline = now + suspect_after
        self.generation = 0   # bumped on every health change: a stale probe's answer is ignored


class Membership:
    """Run with `await nursery.start(membership.run)`; feed it add/heard_from/lost/remove."""

    def __init__(self, probe: Probe, *, interval: float = 0.25, suspect_after: float | None = None,
                 probe_timeout: float = 0.5, in_message: Callable[[str], bool] | None = None,
                 message_grace: float = MESSAGE_GRACE):
        self.interval = interval                              # how often members send heartbeats
        self.suspect_after = suspect_after or 3 * interval    # silence that makes a member suspect
        self.probe_timeout = probe_timeout
        self._probe = probe
        self._in_message = in_message  # is a message from this member part-way in? (MESSAGE_GRACE)
        self.message_grace = message_grace
        self.members: dict[str, Liveness] = {}
        self.log: list[MembershipEvent] = []
        self._subscribers: list[trio.MemorySendChannel] = []
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None

    # -- what the owner tells us --------------------------------------------------------

    def add(self, node_id: str, reason: str = "") -> None:
        if node_id in self.members:
            self.heard_from(node_id)
            return
        self.members[node_id] = Liveness(node_id, trio.current_time(), self.suspect_after)
        self._emit(node_id, "joined", reason)
        self._wake.set()

    def heard_from(self, node_id: str) -> None:
        """Any sign of life from `node_id`."""
        member = self.members.get(node_id)
        if member is None:
            return
        now = trio.current_time()
        member.last_heard = now
        member.deadline = now + self.suspect_after
        if member.health != ALIVE:
            self._set(member, ALIVE, "recovered", "heard from it again")
            self._wake.set()

    def lost(self, node_id: str, reason: str) -> None:
        """Its connection broke: suspect it now and probe, without waiting for the deadline."""
        member = self.members.get(node_id)
        if member is not None and member.health == ALIVE:
            self._suspect(member, reason)

    def remove(self, node_id: str, reason: str = "") -> None:
        if self.members.pop(node_id, None) is not None:
            self._emit(node_id, "left", reason)

    # -- what the owner asks ----------------------------------------------------------

    def health(self, node_id: str) -> str | None:
        member = self.members.get(node_id)
        return member.health if member else None

    def subscribe(self) -> trio.MemoryReceiveChannel:
        """A channel receiving every MembershipEvent from now on."""
        send, receive = trio.open_memory_channel(math.inf)
        self._subscribers.append(send)
        return receive

    # -- running ----------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                now = trio.current_time()
                next_deadline = math.inf
                for member in list(self.members.values()):
                    if member.health != ALIVE:
                        continue
                    if member.deadline <= now:
                        self._suspect(member, f"no heartbeat for {now - member.last_heard:.2f} s")
                    else:
                        next_deadline = min(next_deadline, member.deadline)
                self._wake = trio.Event()
                with trio.move_on_at(next_deadline):
                    await self._wake.wait()

    # -- inside -----------------------------------------------------------------------

    def _suspect(self, member: Liveness, reason: str) -> None:
        self._set(member, SUSPECT, "suspect", reason)
        self._nursery.start_soon(self._run_probe, member, member.generation)

    async def _run_probe(self, member: Liveness, generation: int) -> None:
        started = trio.current_time()
        while True:
            answered = False
            with trio.move_on_after(self.probe_timeout):
                try:
                    answered = await self._probe(member.node_id)
                except Exception:  # noqa: BLE001 - a probe that breaks is a probe that failed
                    answered = False
            if member.generation != generation or self.members.get(member.node_id) is not member:
                return  # heard from it meanwhile, or it left
            if answered or not self._answer_queued(member):
                break
        if answered:
            member.last_heard = trio.current_time()
            member.deadline = member.last_heard + self.suspect_after
            self._set(member, ALIVE, "recovered", "answered a probe")
            self._wake.set()
        else:
            waited = trio.current_time() - started
            why = f"no answer to a probe within {self.probe_timeout:g} s" if waited <= self.probe_timeout + 1e-9 \
                else f"no answer to probes for {waited:.1f} s, part of it behind a message of its still arriving"
            self._set(member, DEAD, "dead", why)

    def _answer_queued(self, member: Liveness) -> bool:
        """Is its answer behind a message of its still arriving, heard from within the grace?"""
        return self._in_message is not None and self._in_message(member.node_id) \
            and trio.current_time() - member.last_heard < self.message_grace

    def _set(self, member: Liveness, health: str, kind: str, reason: str) -> None:
        member.health = health
        member.generation += 1
        self._emit(member.node_id, kind, reason)

    def _emit(self, node_id: str, kind: str, reason: str) -> None:
        event = MembershipEvent(node_id, kind, trio.current_time(), reason)
        self.log.append(event)
        for send in self._subscribers:
            try:
                send.send_nowait(event)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass
