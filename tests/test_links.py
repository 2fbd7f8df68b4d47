"""A run's own links (swarm/execution/links.py): made on first use, one per device; a send that
fails, a connection that cannot be made or one closed under the run is reported once and what
would go there dropped; they all close when the run ends. Fake connections, virtual time."""
from __future__ import annotations

import pytest
import trio
import trio.testing

from swarm.cluster.remote_job import CoordinatorJob
from swarm.execution.links import RunLinks, Turns
from swarm.net import ConnectionLost, PeerUnavailable

pytestmark = pytest.mark.trio

DEVICES = {"dev1": {"node_id": "n1", "address": "10.0.0.1:4750"},
           "dev2": {"node_id": "n2", "address": "10.0.0.2:4750"}}


class FakeConn:
    def __init__(self, peer_id: str, address: str):
        self.peer_id, self.address = peer_id, address
        self.closed = False
        self.sent: list = []
        self.fail = False

    async def send(self, message) -> None:
        await trio.lowlevel.checkpoint()
        if self.fail or self.closed:
            raise ConnectionLost(f"connection to {self.address} broke: reset")
        self.sent.append(message)

    async def aclose(self, reason: str = "") -> None:
        self.closed = True


class Agent:
    """ctx.connect without a node id: always a new connection (unreachable: PeerUnavailable)."""

    def __init__(self, peer_ids=None):
        self.opened: list[FakeConn] = []
        self.peer_ids = peer_ids or {d["address"]: d["node_id"] for d in DEVICES.values()}
        self.unreachable: set[str] = set()

    async def connect(self, address: str) -> FakeConn:
        await trio.lowlevel.checkpoint()
        if address in self.unreachable:
            raise PeerUnavailable(f"cannot reach {address}")
        conn = FakeConn(self.peer_ids[address], address)
        self.opened.append(conn)
        return conn


def links_of(agent: Agent):
    reports: list[tuple[str, str]] = []

    async def report(name: str, why: str) -> None:
        reports.append((name, why))
    return RunLinks(DEVICES, agent.connect, report), reports


async def test_one_new_connection_per_device_closed_when_the_run_ends():
    agent = Agent()
    links, reports = links_of(agent)
    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(links.send, "dev1", f"a{i}")
            nursery.start_soon(links.send, "dev2", f"b{i}")
    assert [c.peer_id for c in agent.opened] == ["n1", "n2"] or [c.peer_id for c in agent.opened] == ["n2", "n1"]
    assert sorted(m for c in agent.opened for m in c.sent) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    await links.aclose()
    assert all(c.closed for c in agent.opened) and reports == []


async def test_small_messages_take_a_lane_of_their_own_that_a_big_one_does_not_hold_up():
    """A connection sends one whole message at a time: a small one (a group's BatchNorm
    sums) goes on a second connection to the device, so that a big one in flight there
    (gradients) does not make it wait; either connection breaking is the device's loss."""
    agent = Agent()
    links, reports = links_of(agent)
    gate = trio.Event()
    await links.send("dev1", "bulk-0")
    big = agent.opened[0]

    async def slow_send(message) -> None:  # a big message still going out
        await gate.wait()
        big.sent.append(message)
    big.send = slow_send
    async with trio.open_nursery() as nursery:
        nursery.start_soon(links.send, "dev1", "bulk-1")
        await links.send("dev1", "bn", True)  # does not wait for bulk-1
        assert len(agent.opened) == 2 and agent.opened[1].sent == ["bn"] and big.sent == ["bulk-0"]
        await links.send("dev1", "bn-2", True)
        gate.set()
    assert big.sent == ["bulk-0", "bulk-1"] and agent.opened[1].sent == ["bn", "bn-2"]
    agent.opened[1].fail = True
    await links.send("dev1", "bn-3", True)
    await links.send("dev1", "bulk-2")
    assert [name for name, _ in reports] == ["dev1"] and big.sent == ["bulk-0", "bulk-1"]
    await links.aclose()
    assert all(c.closed for c in agent.opened)


async def test_waiting_messages_go_lowest_priority_first_and_a_cancelled_one_gives_up_its_turn():
    """While a message is going out, the ones that queue behind it on that connection go in
    the order of their priority (arrival among equals); one cancelled while it waits, or as
    its turn comes, leaves the order of the others as it was."""
    agent = Agent()
    links, _ = links_of(agent)
    await links.send("dev1", "first")
    conn = agent.opened[0]
    gate = trio.Event()

    async def slow_send(message) -> None:
        if message == "held":
            await gate.wait()
        conn.sent.append(message)
    conn.send = slow_send
    order = [("grads-9", (1, 0, 9)), ("act", (0,)), ("grads-3", (1, 0, 3)), ("bn", (0,)), ("old-grads-12", (1, -1, 12))]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(links.send, "dev1", "held")
        await trio.testing.wait_all_tasks_blocked()
        for message, priority in order:
            nursery.start_soon(links.send, "dev1", message, False, priority)
            await trio.testing.wait_all_tasks_blocked()
        gone = trio.CancelScope()

        async def never() -> None:  # waits, then is cancelled before its turn
            with gone:
                await links.send("dev1", "never", False, (0,))
        nursery.start_soon(never)
        await trio.testing.wait_all_tasks_blocked()
        gone.cancel()
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert conn.sent == ["first", "held", "act", "bn", "old-grads-12", "grads-3", "grads-9"]
    await links.send("dev1", "after")  # the lane is free again
    assert conn.sent[-1] == "after"


async def test_a_send_cancelled_as_its_turn_comes_passes_the_turn_on():
    turns = Turns()
    await turns.acquire(())
    got = []

    scope = trio.CancelScope()

    async def wait_turn(name, priority):
        with scope if name == "a" else trio.CancelScope():
            await turns.acquire(priority)
            got.append(name)
            turns.release()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_turn, "a", (0,))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait_turn, "b", (1,))
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # "a" is cancelled, and before it runs...
        turns.release()  # ...the turn is handed to it: it passes the turn to "b"
    assert got == ["b"] and not turns.busy and not turns.waiting


async def test_a_send_cancelled_before_it_takes_a_free_turn_leaves_the_lane_free():
    agent = Agent()
    links, _ = links_of(agent)
    with trio.CancelScope() as scope:
        scope.cancel()
        await links.send("dev1", "never", False, (0,))
    with trio.fail_after(1):
        await links.send("dev1", "after")
    assert agent.opened[0].sent == ["after"]


async def test_a_failed_send_is_reported_once_and_later_messages_dropped():
    agent = Agent()
    links, reports = links_of(agent)
    await links.send("dev1", "first")
    agent.opened[0].fail = True
    await links.send("dev1", "lost")
    await links.send("dev1", "dropped")
    assert reports == [("dev1", "ConnectionLost: connection to 10.0.0.1:4750 broke: reset")]
    assert agent.opened[0].sent == ["first"] and len(agent.opened) == 1  # no second connection in this run


async def test_an_unreachable_or_wrong_device_is_reported():
    agent = Agent(peer_ids={"10.0.0.1:4750": "n1", "10.0.0.2:4750": "someone-else"})
    agent.unreachable.add("10.0.0.1:4750")
    links, reports = links_of(agent)
    await links.send("dev1", "x")
    await links.send("dev2", "y")
    assert [name for name, _ in reports] == ["dev1", "dev2"]
    assert "cannot reach" in reports[0][1] and "not dev2" in reports[1][1]
    assert all(c.closed for c in agent.opened)  # the wrong one is closed at once


async def test_a_connection_closed_under_the_run_is_reported(autojump_clock):
    agent = Agent()
    links, reports = links_of(agent)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(links.watch)
        await links.send("dev2", "x")
        await trio.sleep(1)
        assert reports == []
        agent.opened[0].closed = True  # the far end closed it, or it broke
        await trio.sleep(1)
        assert reports == [("dev2", "the connection to 10.0.0.2:4750 closed")]
        await links.aclose()  # closing our own is no news
        await trio.sleep(1)
        assert len(reports) == 1
        nursery.cancel_scope.cancel()


# ---- the coordinator's side: RosterControl --------------------------------------------------

class _Events:
    def __aiter__(self):
        return self

    async def __anext__(self):
        await trio.sleep_forever()


class _Handle:
    async def assign(self, node_id, kind, spec):
        pass

    async def start(self, node_id):
        pass

    assign_and_start = CoordinatorJob.assign_and_start  # the real one, over the fake assign and start

    def data(self, channel, body):
        return body

    async def wait_done(self, node_id):
        await trio.sleep_forever()

    async def receive(self, channel):
        await trio.sleep_forever()


class _Cluster:
    def __init__(self):
        from types import SimpleNamespace

        self.credentials = SimpleNamespace(node_id="coordinator")
        self.devices = {f"n{i}": SimpleNamespace(health="alive", conn=FakeConn(f"n{i}", "?")) for i in range(3)}

    def subscribe(self):
        return _Events()

    def job(self, job_id, epoch=0):
        return _Handle()

    def device(self, node_id):
        return self.devices[node_id]


async def _started(nursery, monkeypatch, epoch: int = 0):
    from types import SimpleNamespace

    from swarm.execution import launch
    from swarm.execution.launch import RosterControl

    monkeypatch.setattr(launch, "job_spec_dict", lambda job, devices: {})
    cluster = _Cluster()
    names = {f"dev{i}": SimpleNamespace(node_id=f"n{i}", address="127.0.0.1", port=4750 + i) for i in range(3)}
    control = RosterControl(cluster, "run", names, nursery, lambda text: None)
    job = SimpleNamespace(plan=SimpleNamespace(used_devices=lambda: ["dev0", "dev1", "dev2"]))
    endpoint = await control.start_epoch(epoch, job)
    return control, cluster, endpoint, job


async def test_a_reported_link_is_the_loss_of_its_far_end(monkeypatch, autojump_clock):
    async with trio.open_nursery() as nursery:
        control, _, endpoint, _ = await _started(nursery, monkeypatch)
        endpoint.deliver({"k": ["link", "dev0", "dev2"], "p": {"reason": "reset"}})
        endpoint.deliver({"k": ["link", "dev1", "dev2"], "p": {"reason": "reset"}})  # the same news
        assert await control.next_loss() == {"dev2"}
        with trio.move_on_after(0.5) as waited:
            await control.next_loss()
        assert waited.cancelled_caught
        nursery.cancel_scope.cancel()


async def test_a_broken_or_replaced_connection_to_a_device_is_its_loss(monkeypatch, autojump_clock):
    async with trio.open_nursery() as nursery:
        control, cluster, _, _ = await _started(nursery, monkeypatch)
        await trio.sleep(1)
        cluster.devices["n1"].conn = FakeConn("n1", "?")  # the cluster reconnected: messages may be lost
        assert await control.next_loss() == {"dev1"}
        cluster.devices["n2"].conn.closed = True
        assert await control.next_loss() == {"dev2"}
        nursery.cancel_scope.cancel()


async def test_a_broken_link_is_no_news_to_a_later_epoch(monkeypatch, autojump_clock):
    async with trio.open_nursery() as nursery:
        control, _, endpoint, job = await _started(nursery, monkeypatch)
        endpoint.deliver({"k": ["link", "dev0", "dev2"], "p": {"reason": "reset"}})
        await control.start_epoch(1, job)  # a re-plan for another reason came first
        with trio.move_on_after(0.5) as waited:
            await control.next_loss()
        assert waited.cancelled_caught
        nursery.cancel_scope.cancel()


async def test_small_gradient_shares_take_the_quick_lane_only_where_nothing_small_waits_on_the_compute():
    """quick_limit: a plan of whole micro-batches per device (replicas of one stage) sends the
    front layers' small gradient shares on the quick lane; where a group's BatchNorm exchanges
    or tiles' halos travel there, the shares stay on the bulk lane."""
    from planner.plan import Plan, Stage
    from swarm.execution.links import QUICK_BYTES, QUICK_SHARES_BYTES, quick_limit

    devices = [f"dev{i}" for i in range(4)]

    def plan(*stages):
        return Plan("yolov2-16", 416, 8, 8, list(stages), devices={d: {} for d in devices})

    singles = plan(Stage(0, 17, "single", devices, replicas=4))
    dp_whole = plan(Stage(0, 17, "dp", devices, allocation={d: 1 for d in devices}, replicas=4, groups=[1, 1, 1, 1]))
    pairs = plan(Stage(0, 17, "dp", devices, allocation={d: 1 for d in devices}, replicas=2, groups=[2, 2]))
    pipeline = plan(Stage(0, 8, "single", devices[:1]), Stage(8, 17, "single", devices[1:2]))
    assert quick_limit(singles) == quick_limit(dp_whole) == QUICK_SHARES_BYTES > 88_000
    assert quick_limit(pairs) == quick_limit(pipeline) == QUICK_BYTES < 88_000


async def test_a_run_opens_both_lanes_to_its_peers_at_the_start_and_reports_one_it_cannot_reach():
    """open_to: both connections to each device made at once, before anything is sent (the
    first sends then find them open); a device that cannot be reached is reported once, as
    a send to it would be, and what would go there dropped."""
    agent = Agent()
    agent.unreachable.add("10.0.0.2:4750")
    links, reports = links_of(agent)
    await links.open_to(["dev1", "dev2"])
    assert sorted(links.conns) == [("dev1", False), ("dev1", True)]
    assert [name for name, _ in reports] == ["dev2"] and "cannot reach" in reports[0][1]
    await links.send("dev1", "x")
    await links.send("dev1", "y", quick=True)
    await links.send("dev2", "z")
    assert len(agent.opened) == 2 and [c.sent for c in agent.opened] in (
        [["x"], ["y"]], [["y"], ["x"]]) and len(reports) == 1
    await links.aclose()


async def test_a_run_opens_links_to_the_devices_of_its_stages_and_their_neighbours():
    from planner.plan import Plan, Stage
    from swarm.execution.train_job import peers_of

    names = [f"dev{i}" for i in range(5)]
    plan = Plan("yolov2-16", 416, 8, 8, [Stage(0, 4, "single", ["dev0"]), Stage(4, 8, "dp", ["dev1", "dev2"],
                                                                              allocation={"dev1": 1, "dev2": 1}),
                                       Stage(8, 12, "single", ["dev3"]), Stage(12, 17, "single", ["dev4"])],
                devices={d: {} for d in names})
    assert peers_of(plan, "dev0") == {"dev1", "dev2"}
    assert peers_of(plan, "dev1") == {"dev0", "dev2", "dev3"}
    assert peers_of(plan, "dev4") == {"dev3"}
