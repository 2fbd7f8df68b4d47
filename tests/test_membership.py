"""Membership in virtual time: exact moments of suspect, dead and recovered."""
from __future__ import annotations

import pytest
import trio

from swarm.cluster.membership import Membership

pytestmark = pytest.mark.trio


class FakeDevice:
    """Sends heartbeats every `interval` until told to stop; answers probes if `answers`."""

    def __init__(self, membership: Membership, node_id: str, interval: float = 0.25):
        self.membership, self.node_id, self.interval = membership, node_id, interval
        self.beating = True
        self.answers = True
        self.probe_delay = 0.125

    async def heartbeats(self):
        while True:
            if self.beating:
                self.membership.heard_from(self.node_id)
            await trio.sleep(self.interval)


def setup(nursery, devices: dict, **kw) -> Membership:
    async def probe(node_id):
        device = devices[node_id]
        if not device.answers:
            await trio.sleep_forever()
        await trio.sleep(device.probe_delay)
        return True

    return Membership(probe, interval=0.25, probe_timeout=0.5, **kw)


def start_beating(nursery, membership: Membership, devices: dict, names) -> None:
    """Devices of these names join and send heartbeats."""
    for name in names:
        devices[name] = FakeDevice(membership, name)
        membership.add(name)
        nursery.start_soon(devices[name].heartbeats)


def timeline(membership: Membership) -> list[tuple[str, str, float]]:
    return [(e.node_id, e.kind, e.time) for e in membership.log]


async def test_silent_device_is_suspect_then_dead_at_exact_times(autojump_clock):
    devices = {}
    async with trio.open_nursery() as nursery:
        membership = setup(nursery, devices)
        await nursery.start(membership.run)
        start_beating(nursery, membership, devices, ("a", "b"))
        await trio.sleep(1.1)
        devices["b"].beating = False      # last heartbeat of b was at t=1.0
        devices["b"].answers = False
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    assert timeline(membership) == [("a", "joined", 0.0), ("b", "joined", 0.0),
                                    ("b", "suspect", 1.75),   # 1.0 + 3 intervals of silence
                                    ("b", "dead", 2.25)]      # + probe timeout 0.5
    assert membership.health("a") == "alive" and membership.health("b") == "dead"


async def test_slow_but_alive_device_recovers_after_its_probe(autojump_clock):
    devices = {}
    async with trio.open_nursery() as nursery:
        membership = setup(nursery, devices)
        await nursery.start(membership.run)
        devices["a"] = FakeDevice(membership, "a")
        membership.add("a")
        # no heartbeats at all: suspect at 0.75, probe answers 0.125 s later
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert timeline(membership)[:3] == [("a", "joined", 0.0), ("a", "suspect", 0.75), ("a", "recovered", 0.875)]


async def test_dead_device_that_comes_back_is_recovered(autojump_clock):
    devices = {}
    async with trio.open_nursery() as nursery:
        membership = setup(nursery, devices)
        await nursery.start(membership.run)
        device = devices["a"] = FakeDevice(membership, "a")
        device.answers = False
        membership.add("a")
        nursery.start_soon(device.heartbeats)
        await trio.sleep(0.6)
        device.beating = False            # last heartbeat at 0.5: suspect 1.25, dead 1.75
        await trio.sleep(2.5)             # t = 3.1
        device.beating = True             # a cut link healed: the next heartbeat (3.25) gets through
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert timeline(membership) == [("a", "joined", 0.0), ("a", "suspect", 1.25), ("a", "dead", 1.75),
                                    ("a", "recovered", 3.25)]


async def test_broken_connection_is_suspected_at_once(autojump_clock):
    devices = {}
    async with trio.open_nursery() as nursery:
        membership = setup(nursery, devices)
        await nursery.start(membership.run)
        device = devices["a"] = FakeDevice(membership, "a")
        device.answers = False
        membership.add("a")
        nursery.start_soon(device.heartbeats)
        await trio.sleep(0.3)
        device.beating = False
        membership.lost("a", "connection closed")   # t = 0.3, well before the deadline
        await trio.sleep(2.0)
        nursery.cancel_scope.cancel()
    assert timeline(membership) == [("a", "joined", 0.0), ("a", "suspect", 0.3), ("a", "dead", 0.8)]
    assert membership.log[1].reason == "connection closed"


async def test_left_and_subscribers(autojump_clock):
    devices = {}
    async with trio.open_nursery() as nursery:
        membership = setup(nursery, devices, suspect_after=0.5)
        events = membership.subscribe()
        await nursery.start(membership.run)
        devices["a"] = FakeDevice(membership, "a")
        devices["a"].answers = False
        membership.add("a")
        await trio.sleep(0.25)
        membership.remove("a", "mDNS goodbye")
        await trio.sleep(2.0)
        nursery.cancel_scope.cancel()
    seen = []
    while True:
        try:
            seen.append(events.receive_nowait())
        except trio.WouldBlock:
            break
    assert [(e.kind, e.time) for e in seen] == [("joined", 0.0), ("left", 0.25)]  # no suspect after leaving


async def test_a_member_whose_message_is_still_arriving_is_given_the_grace_not_one_probe(autojump_clock):
    """Its answer to a probe is queued behind its message: while that message is part-way
    in, it is probed again until it has been message_grace without a byte; a message that
    completes, or a connection that breaks, ends that at the next probe, and a byte heard
    recovers it."""
    async def run(script) -> list:
        devices, arriving, t0 = {}, {"b": True}, trio.current_time()
        async with trio.open_nursery() as nursery:
            membership = setup(nursery, devices, in_message=lambda node: arriving.get(node, False),
                               message_grace=3.0)
            await nursery.start(membership.run)
            start_beating(nursery, membership, devices, ("a", "b"))
            await trio.sleep(1.1)
            devices["b"].beating = devices["b"].answers = False  # last heard at t=1.0
            await script(membership, arriving)
            nursery.cancel_scope.cancel()
        reasons.extend(e.reason for e in membership.log if e.node_id == "b" and e.kind == "dead")
        return [(e.kind, round(e.time - t0, 6)) for e in membership.log if e.node_id == "b"][1:]

    async def silent(membership, arriving):
        await trio.sleep(6.0)
    # suspect at 1.75; probes time out at 2.25, 2.75, 3.25, 3.75 within the grace; 4.25 is past it
    reasons = []
    assert await run(silent) == [("suspect", 1.75), ("dead", 4.25)]
    assert reasons == ["no answer to probes for 2.5 s, part of it behind a message of its still arriving"]

    async def completes(membership, arriving):
        await trio.sleep(2.5 - 1.1)
        arriving["b"] = False  # the message is in: its answer would have followed it
        await trio.sleep(3.0)
    assert await run(completes) == [("suspect", 1.75), ("dead", 2.75)]
    assert reasons[-1] == "no answer to probes for 1.0 s, part of it behind a message of its still arriving"

    async def bytes_arrive(membership, arriving):
        await trio.sleep(3.0 - 1.1)
        membership.heard_from("b")
        await trio.sleep(0.1)
    assert await run(bytes_arrive) == [("suspect", 1.75), ("recovered", 3.0)]


class CountedMembers(dict):
    """Membership's table of members, counting how many members its deadline scans visit."""

    def __init__(self):
        super().__init__()
        self.visits = 0

    def values(self):
        self.visits += len(self)
        return super().values()


async def test_a_classroom_of_256_members_loses_exactly_the_silent_one_without_a_scan_per_heartbeat(autojump_clock):
    """256 members join over a second and beat every 0.25 s; the one that falls silent is suspect
    3 intervals after its last heartbeat and dead a probe timeout later, and nobody else changes.
    The deadline scan walks every member, so it must run about once per deadline, not once per
    heartbeat: while they all beat, it visits each member a few times a second, where a scan at
    every heartbeat visits each member hundreds of times a second (256 with these heartbeats)."""
    count = 256
    devices = {}
    async with trio.open_nursery() as nursery:
        membership = setup(nursery, devices)
        membership.members = CountedMembers()
        await nursery.start(membership.run)
        for k in range(count):                 # member k joins at k/256 s (exact in binary)
            start_beating(nursery, membership, devices, [f"m{k}"])
            await trio.sleep(1 / count)
        await trio.sleep(0.5)                  # t = 1.5: everyone has joined and beaten
        visits, since = membership.members.visits, trio.current_time()
        await trio.sleep(0.5)                  # t = 2.0
        per_member_second = (membership.members.visits - visits) / count / (trio.current_time() - since)
        devices["m100"].beating = devices["m100"].answers = False   # it last beat at 100/256 + 6 * 0.25
        await trio.sleep(2.0)
        nursery.cancel_scope.cancel()
    last_beat = 100 / 256 + 6 * 0.25
    changes = [(n, kind, t) for n, kind, t in timeline(membership) if kind != "joined"]
    assert changes == [("m100", "suspect", last_beat + 0.75), ("m100", "dead", last_beat + 0.75 + 0.5)]
    assert sum(kind == "joined" for _, kind, _ in timeline(membership)) == count
    assert all(membership.health(f"m{k}") == "alive" for k in range(count) if k != 100)
    assert per_member_second <= 4, f"the deadline scan visited each member {per_member_second:g} times a second"
