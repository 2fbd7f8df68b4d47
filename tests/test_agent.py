"""Agents and a coordinator in one trio loop on 127.0.0.1: probes, jobs, epochs, peers, strangers."""
from __future__ import annotations

import gc
import itertools
import logging
import os
import random
import time
import weakref
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio

from swarm.agent import Agent, AgentConfig, JobContext, register_job_kind
from swarm.cluster import JobError, open_roster
from swarm.net import Credentials, connect_peer, resolve_network
from swarm.profiling.bandwidth import measure_bandwidth, probe_rounds
from swarm.wire import PROTOCOL_VERSION, JobData, Ping, Pong
from swarm.wire.frames import LENGTH

pytestmark = pytest.mark.trio

TOKEN = "test-token-" + "x" * 20
OTHER_TOKEN = "other-token-" + "y" * 20


@asynccontextmanager
async def swarm_of(n: int, *, tokens=None, orphan_timeout=30.0, **cluster_options):
    """n agents (mDNS off) and a cluster reaching them by --peers, all on loopback."""
    network = resolve_network("lo")
    tokens = tokens or [TOKEN] * n
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            agents = []
            for i in range(n):
                config = AgentConfig(name=f"a{i}", node_id=f"node{i}", token=tokens[i], network=network, port=0,
                                     advertise=False, orphan_timeout=orphan_timeout)
                agents.append(await nursery.start(Agent(config).run))
            peers = [("127.0.0.1", a.port) for a in agents]
            async with open_roster(Credentials("coordinator", TOKEN), network, peers=peers, discover=False,
                                    **cluster_options) as cluster:
                await cluster.wait_for(sum(t == TOKEN for t in tokens), timeout=10)
                yield agents, cluster
            nursery.cancel_scope.cancel()


async def test_agents_describe_themselves_and_send_heartbeats():
    async with swarm_of(2, heartbeat_interval=0.05) as (agents, cluster):
        devices = cluster.devices()
        assert [d.name for d in devices] == ["a0", "a1"]
        for device, agent in zip(devices, agents):
            assert (device.node_id, device.port, device.cores, device.memory) == \
                   (agent.node_id, agent.port, agent.cores, agent.memory)
            assert device.health == "alive" and device.rtt is not None
        first = devices[0].last_seen
        await trio.sleep(0.3)
        assert devices[0].last_seen > first   # heartbeats keep arriving
        assert all(m.health == "alive" for m in cluster.membership.members.values())


async def test_an_agent_offers_the_accelerator_it_is_told_to():
    """`swarm join --accelerator cpu` keeps a GPU out of the swarm: the roster sees what the
    agent offers, not what the host has."""
    from swarm.host.accelerator import accelerator

    network = resolve_network("lo")
    async with trio.open_nursery() as nursery:
        offered = []
        for i, choice in enumerate((None, "cuda", "cpu")):
            config = AgentConfig(name=f"a{i}", node_id=f"node{i}", token=TOKEN, network=network, port=0,
                                 advertise=False, accelerator=choice)
            agent = await nursery.start(Agent(config).run)
            offered.append(agent.accelerator)
        assert offered == [accelerator(), "cuda", "cpu"]
        nursery.cancel_scope.cancel()


async def test_bandwidth_job_measures_both_directions_peer_to_peer():
    async with swarm_of(3) as (agents, cluster):  # three: each round of probes leaves one device out
        ids = [a.node_id for a in agents]
        results = await measure_bandwidth(cluster, ids, nbytes=1 << 20)
        assert set(results) == set(itertools.permutations(ids, 2))
        for r in results.values():
            assert r["nbytes"] == 1 << 20 and r["seconds"] > 0 and r["latency"] > 0 and r["bytes_per_second"] > 0
            # each end's cost of a gradient share on a lane of its own (swarm.execution.lane): a
            # byte's under the event loop's, as the lanes are built to be, and a share's ms or less
            for end in ("from", "to"):
                assert 0 < r["lane_s_per_byte"][end] < r["comm_s_per_byte"][end]
                assert 0 <= r["lane_msg_s"][end] < 1e-3
        await trio.sleep(0.05)
        assert all(a.job is None for a in agents)  # released
        assert not any(a._early_lanes for a in agents)  # every probe's lane went to its job


async def test_lane_costs_are_the_line_through_the_two_sizes_over_the_cpu_share():
    from swarm.profiling.bandwidth import lane_costs

    # 100 us a share and 2 ns a byte, measured three times at each size (the median is taken)
    shares = [(size, 100e-6 + 2e-9 * size + noise) for size in (32768, 524288) for noise in (-1e-6, 0.0, 5e-6)]
    costs = lane_costs(shares, 0.5)
    assert costs["lane_s_per_byte"] == pytest.approx(4e-9) and costs["lane_msg_s"] == pytest.approx(200e-6)
    # a line that starts below zero: all of the larger shares' cost is their bytes'
    assert lane_costs([(1000, 1e-6), (2000, 5e-6)], 1.0) == {"lane_s_per_byte": 2.5e-9, "lane_msg_s": 0.0}
    assert lane_costs([(1000, 1e-6)], 1.0) == {}  # one size gives no line


async def test_a_lane_probe_that_fails_leaves_the_lanes_unmeasured_and_the_links_measured(monkeypatch):
    from swarm.agent import lane

    def broken(self, key, array, timeout):
        raise lane.LaneBroken(self.name, "send failed: the test's", report=False)

    monkeypatch.setattr(lane.Lane, "send", broken)
    async with swarm_of(2) as (agents, cluster):
        with trio.fail_after(20):  # the far end, left waiting for shares, is woken when the lane closes
            results = await measure_bandwidth(cluster, [a.node_id for a in agents], nbytes=1 << 18)
        assert all(r["lane_s_per_byte"] == {"from": 0.0, "to": 0.0} and r["comm_s_per_byte"]["from"] > 0
                   for r in results.values())


async def test_bandwidth_job_leaves_the_lanes_unmeasured_where_runs_do_not_sum_on_them(monkeypatch):
    monkeypatch.setenv("SWARM_SUM_LANES", "0")
    async with swarm_of(2) as (agents, cluster):
        results = await measure_bandwidth(cluster, [a.node_id for a in agents], nbytes=1 << 18)
        assert all(r["lane_s_per_byte"] == {"from": 0.0, "to": 0.0} and r["comm_s_per_byte"]["from"] > 0
                   for r in results.values())


@pytest.mark.parametrize("n", range(1, 10))
async def test_probe_rounds_take_every_ordered_pair_once_and_no_device_twice_at_a_time(n):
    nodes = [f"n{i}" for i in range(n)]
    rounds = probe_rounds(nodes)
    assert sorted(p for pairs in rounds for p in pairs) == sorted(itertools.permutations(nodes, 2))
    assert all(len({d for p in pairs for d in p}) == 2 * len(pairs) for pairs in rounds)
    assert len(rounds) == (2 * (n - 1) if n % 2 == 0 else 2 * n if n > 1 else 0)


class Recorder:
    """A job kind for tests: echoes "in" messages back to the coordinator, doubling their
    tensor in a worker thread; returns how many it handled when told to stop."""

    def __init__(self):
        self.contexts: list[JobContext] = []
        self.cancelled = 0

    async def __call__(self, ctx: JobContext) -> dict:
        self.contexts.append(ctx)
        handled = 0
        try:
            while True:
                sender, msg = await ctx.receive("in")
                if msg.body == "finish":
                    return {"handled": handled, "spec": ctx.spec}
                doubled = await ctx.run_in_thread(np.multiply, msg.body["x"], 2)
                handled += 1
                ctx.progress["handled"] = handled
                await ctx.send(sender, ctx.data("out", {"x": doubled, "epoch": ctx.epoch}))
        except trio.Cancelled:
            self.cancelled += 1
            raise


@pytest.fixture
def recorder():
    kind = f"recorder-{random.randrange(10**9)}"
    rec = Recorder()
    register_job_kind(kind, rec)
    rec.kind = kind
    return rec


async def test_job_lifecycle_messages_tensors_and_progress(recorder):
    async with swarm_of(1, heartbeat_interval=0.05) as (agents, cluster):
        node = agents[0].node_id
        job = cluster.job("j1", epoch=0)
        assert (await job.assign(node, recorder.kind, {"plan": [1, 2]})).state == "assigned"
        assert (await job.start(node)).state == "running"
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        for _ in range(3):
            await job.send(node, job.data("in", {"x": x}))
            sender, reply = await job.receive("out")
            assert sender == node and np.array_equal(reply.body["x"], 2 * x)
        await trio.sleep(0.2)
        assert cluster.device(node).job_state == "running"
        assert agents[0].job.ctx.progress == {"handled": 3}
        await job.send(node, job.data("in", "finish"))
        assert await job.wait_done(node) == {"handled": 3, "spec": {"plan": [1, 2]}}
        await job.release(node)
        assert agents[0].job is None


async def test_a_slow_device_holds_up_no_other_devices_start_and_a_refusal_is_its_own(recorder):
    async with swarm_of(4) as (agents, cluster):
        nodes = [a.node_id for a in agents]
        others_running = trio.Event()
        plain_assign = agents[0]._assign

        async def slow_assign(peer, msg):  # the first device answers only once the others run
            await others_running.wait()
            await plain_assign(peer, msg)

        agents[0]._assign = slow_assign
        await cluster.job("elsewhere").assign(nodes[3], recorder.kind, {})  # busy: refuses
        job = cluster.job("j", epoch=0)

        async def watch():
            while not all(cluster.device(n).job_state == "running" for n in nodes[1:3]):
                await trio.sleep(0.01)
            others_running.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            failed = await job.assign_and_start(recorder.kind, {n: {"n": n} for n in nodes})
        assert list(failed) == [nodes[3]] and "busy with job elsewhere" in str(failed[nodes[3]])
        assert all(agents[i].job.ctx.spec == {"n": nodes[i]} for i in range(3))
        assert [job.states[n].state for n in nodes[:3]] == ["running"] * 3
        with pytest.raises(JobError, match="busy with job elsewhere"):
            await cluster.job("k").assign_and_start(recorder.kind, {n: {} for n in nodes[3:]}, all_or_raise=True)


async def test_stop_cancels_the_run_and_a_failing_job_is_reported(recorder):
    async def failing(ctx):
        raise ValueError("boom")

    register_job_kind("failing-test", failing)
    async with swarm_of(1) as (agents, cluster):
        node = agents[0].node_id
        job = cluster.job("j2")
        await job.assign(node, recorder.kind, {})
        await job.start(node)
        assert (await job.stop(node)).state == "stopped"
        assert recorder.cancelled == 1
        await job.release(node)
        bad = cluster.job("j3")
        await bad.assign(node, "failing-test", {})
        await bad.start(node)
        with pytest.raises(JobError, match="ValueError: boom"):
            await bad.wait_done(node)
        await bad.release(node)
        assert cluster.device(node).health == "alive"


async def test_agent_refuses_unknown_kinds_and_a_second_job(recorder):
    async with swarm_of(1) as (agents, cluster):
        node = agents[0].node_id
        with pytest.raises(JobError, match="unknown job kind 'no-such-kind'"):
            await cluster.job("x").assign(node, "no-such-kind", {})
        await cluster.job("first").assign(node, recorder.kind, {})
        with pytest.raises(JobError, match="busy with job first"):
            await cluster.job("second").assign(node, recorder.kind, {})


async def test_older_epochs_are_refused_and_newer_ones_wait_for_their_assignment(recorder):
    async with swarm_of(1) as (agents, cluster):
        agent, node = agents[0], agents[0].node_id
        old = cluster.job("j", epoch=1)
        await old.assign(node, recorder.kind, {})
        await old.start(node)
        # a message of epoch 2 arrives before epoch 2 is assigned: held, not lost
        await cluster.send(node, JobData("j", 2, "in", {"x": np.ones(2)}))
        new = cluster.job("j", epoch=2)          # the re-plan
        await new.assign(node, recorder.kind, {})
        assert recorder.cancelled == 1           # the epoch-1 run was stopped
        await new.start(node)
        sender, reply = await new.receive("out")
        assert reply.body["epoch"] == 2 and np.array_equal(reply.body["x"], [2, 2])
        # a device cut off during the re-plan still speaks epoch 1: refused, never delivered
        refused_before = agent.refused_messages
        await cluster.send(node, JobData("j", 1, "in", {"x": np.ones(2)}))
        await cluster.send(node, Ping(5))      # ordered after it on the same connection
        await trio.sleep(0.1)
        assert agent.refused_messages == refused_before + 1
        assert [c.epoch for c in recorder.contexts] == [1, 2]
        with pytest.raises(trio.WouldBlock):  # the stale message never reached the epoch-2 run
            recorder.contexts[1].receive_nowait("in")
        with pytest.raises(JobError, match="superseded by epoch 2"):
            await old.assign(node, recorder.kind, {})
        # a coordinator that missed the re-plan cannot take the agent back to epoch 1
        async with open_roster(Credentials("stale-coordinator", TOKEN), cluster.network,
                                peers=[("127.0.0.1", agent.port)], discover=False) as stale:
            await stale.wait_for(1, 10)
            with pytest.raises(JobError, match="older than the job's epoch 2"):
                await stale.job("j", epoch=1).assign(node, recorder.kind, {})


class Cycle:
    """What a run leaves behind in a reference cycle (as torch modules and autograd graphs do):
    freed only by the garbage collector."""

    def __init__(self, freed: list):
        self.me = self
        self.weight = np.ones(1 << 20)
        weakref.finalize(self, freed.append, True)


async def test_a_newer_epochs_run_starts_once_the_older_run_has_ended_and_its_memory_is_back():
    """A re-plan cancels the running epoch, whose compute thread finishes what it is in:
    the new epoch's run must not allocate its stages beside the old ones."""
    kind = f"holder-{random.randrange(10**9)}"
    events, freed = [], []

    async def holder(ctx: JobContext) -> dict:
        events.append(("start", ctx.epoch, bool(freed)))
        if ctx.epoch == 1:
            left = Cycle(freed)  # noqa: F841 (held until the run ends, then only by its cycle)
            try:
                await ctx.run_in_thread(time.sleep, 0.5)  # the micro-batch the thread is in
            finally:
                events.append(("end", ctx.epoch, bool(freed)))
        return {}

    register_job_kind(kind, holder)
    gc.disable()  # only an explicit collection frees the cycle
    try:
        async with swarm_of(1) as (agents, cluster):
            node = agents[0].node_id
            old = cluster.job("j", epoch=1)
            await old.assign(node, kind, {})
            await old.start(node)
            await trio.sleep(0.1)
            new = cluster.job("j", epoch=2)  # the re-plan, while epoch 1's thread computes
            await new.assign(node, kind, {})
            await new.start(node)
            await new.wait_done(node)
    finally:
        gc.enable()
    assert events == [("start", 1, False), ("end", 1, False), ("start", 2, True)]


async def test_job_is_released_when_its_coordinator_stays_away(recorder):
    network = resolve_network("lo")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            agent = await nursery.start(Agent(AgentConfig("a", "node-a", TOKEN, network, port=0, advertise=False,
                                                          orphan_timeout=0.3)).run)
            async with open_roster(Credentials("coordinator", TOKEN), network, peers=[("127.0.0.1", agent.port)],
                                    discover=False) as cluster:
                await cluster.wait_for(1, 10)
                await cluster.job("j").assign("node-a", recorder.kind, {})
                assert agent.job is not None
            await trio.sleep(0.6)   # the coordinator is gone
            assert agent.job is None
            nursery.cancel_scope.cancel()


async def test_agent_with_another_token_cannot_join(caplog):
    caplog.set_level(logging.INFO, logger="swarm")
    async with swarm_of(2, tokens=[TOKEN, OTHER_TOKEN]) as (agents, cluster):
        await trio.sleep(0.2)
        stranger = cluster.device(f"127.0.0.1:{agents[1].port}")
        assert stranger is not None and stranger.health == "refused"
        assert "cluster token" in stranger.error
        assert [d.name for d in cluster.alive()] == ["a0"]
        assert "node1" not in cluster.membership.members
    assert any("refused connection" in r.getMessage() and "cluster token" in r.getMessage() for r in caplog.records)


async def test_nothing_a_stranger_sends_is_acted_on(caplog, recorder):
    caplog.set_level(logging.INFO, logger="swarm")
    async with swarm_of(1) as (agents, cluster):
        agent = agents[0]
        # 1. the wrong token: the handshake fails, and the job assignment sent anyway is never read
        with pytest.raises(Exception, match="cluster token"):
            await connect_peer("127.0.0.1", agent.port, Credentials("intruder", OTHER_TOKEN))
        # 2. no handshake at all: a job assignment as the first frame
        from swarm.wire import encode_frame
        from swarm.wire.messages import JobAssign, to_wire

        raw = await trio.open_tcp_stream("127.0.0.1", agent.port)
        for buf in encode_frame(to_wire(JobAssign("evil", 0, recorder.kind, {}, 0.1)), 1 << 20):
            await raw.send_all(buf)
        assert await read_until_closed(raw)  # the agent says why, then closes
        # 3. another protocol version: told why, in the Goodbye after the agent's own Hello
        raw = await trio.open_tcp_stream("127.0.0.1", agent.port)
        for buf in encode_frame([1, "swarm", 99, "future-node", b"n" * 32], 1 << 20):
            await raw.send_all(buf)
        assert f"version mismatch: we speak {PROTOCOL_VERSION}, the peer speaks 99".encode() in \
            await read_until_closed(raw)
        # 4. garbage, an HTTP request, an oversized frame
        rng = random.Random(4)
        garbage = bytes(rng.randrange(256) for _ in range(5000))
        for payload in [b"GET / HTTP/1.1\r\n\r\n", LENGTH.pack(1 << 31), garbage]:
            raw = await trio.open_tcp_stream("127.0.0.1", agent.port)
            await raw.send_all(payload)
            await read_until_closed(raw)
        assert agent.job is None and recorder.contexts == []
        # everyone else is still served
        conn = cluster.device(agent.node_id).conn
        await conn.send(Ping(77))
        await trio.sleep(0.1)
        assert cluster.device(agent.node_id).health == "alive"
    messages = [r.getMessage() for r in caplog.records]
    assert any("refused connection" in m and "not a swarm peer" in m for m in messages)
    assert any("refused connection" in m and "exceeds the limit" in m for m in messages)
    assert any("refused connection" in m and "protocol version mismatch" in m for m in messages)


async def read_until_closed(stream) -> bytes:
    data = b""
    with trio.fail_after(5):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
            data += chunk
    await stream.aclose()
    return data


async def test_killed_connection_makes_the_device_dead_quickly():
    """The in-process analogue of `swarm testbed kill`: the agent vanishes without goodbye, and
    its closed connection (not a missed heartbeat deadline, set far off here) makes it suspect
    at once and, after one failed probe (0.5 s), dead: well within 2.5 s even on a loaded
    machine (the deadline alone would take 5 s)."""
    network = resolve_network("lo")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def doomed_agent(task_status=trio.TASK_STATUS_IGNORED):
                with scope:
                    await Agent(AgentConfig("a", "node-a", TOKEN, network, port=0, advertise=False)).run(
                        task_status=task_status)

            agent = await nursery.start(doomed_agent)
            async with open_roster(Credentials("c", TOKEN), network, peers=[("127.0.0.1", agent.port)],
                                    discover=False, probe_timeout=0.5, suspect_after=5.0) as cluster:
                await cluster.wait_for(1, 10)
                register_job_kind("forever-test", lambda ctx: trio.sleep_forever())
                job = cluster.job("doomed")
                await job.assign("node-a", "forever-test", {})
                await job.start("node-a")
                events = cluster.subscribe()
                scope.cancel()
                started = trio.current_time()
                kinds = []
                while "dead" not in kinds:
                    kinds.append((await events.receive()).kind)
                assert trio.current_time() - started < 2.5
                assert kinds == ["suspect", "dead"]
                with pytest.raises(JobError, match="lost during job doomed"):
                    await job.wait_done("node-a")
            nursery.cancel_scope.cancel()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux")
async def test_compute_in_threads_does_not_stop_heartbeats(recorder):
    async def busy(ctx):
        import time
        await ctx.run_in_thread(time.sleep, 0.6)  # stands for a long forward pass (releases the GIL)
        return {}

    register_job_kind("busy-test", busy)
    async with swarm_of(1, heartbeat_interval=0.05, suspect_after=0.2) as (agents, cluster):
        node = agents[0].node_id
        job = cluster.job("busy")
        await job.assign(node, "busy-test", {})
        await job.start(node)
        await job.wait_done(node)
        assert [e.kind for e in cluster.membership.log if e.node_id == node] == ["joined"]



async def test_a_running_job_sends_one_stream_of_heartbeats_not_two():
    """The job's heartbeats go to the coordinator on the connection it watches: the watch's own
    heartbeats stay quiet meanwhile, so a busy device sends one per interval, not two."""
    async def busy(ctx):
        await trio.sleep(1.0)
        return {}

    register_job_kind("quiet-test", busy)
    async with swarm_of(1, heartbeat_interval=0.05) as (agents, cluster):
        node = agents[0].node_id
        beats = []
        on_message = cluster._on_message
        cluster._on_message = lambda device, message: (
            beats.append(trio.current_time()) if type(message).__name__ == "Heartbeat" else None,
            on_message(device, message))
        job = cluster.job("quiet")
        await job.assign(node, "quiet-test", {})
        started = trio.current_time()
        await job.start(node)
        await job.wait_done(node)
        during = [t for t in beats if started + 0.2 < t < started + 0.9]
        assert 5 <= len(during) <= 0.7 / 0.05 + 3, len(during)


def nonsense(rng: random.Random, hint):
    """A value of roughly the declared type, chosen to be awkward."""
    import typing

    origin = typing.get_origin(hint)
    if origin is not None and type(None) in typing.get_args(hint):
        return None if rng.random() < 0.3 else nonsense(rng, typing.get_args(hint)[0])
    choices = {
        int: [-1, 0, 1, 2**63 - 1, -2**63, rng.randrange(10**6)],
        float: [float("nan"), float("inf"), -1.0, 0.0, 1e-9, 1e9],
        str: ["", "x", "bandwidth", "\x00", "j" * 5000, "node0"],
        bytes: [b"", b"\xff" * 100],
        dict: [{}, {"done": True}, {"to": "x", "address": "nowhere:1", "nbytes": -5}, {"x": np.zeros((0, 3))}],
    }
    if hint in choices:
        return rng.choice(choices[hint])
    if origin is list:
        return rng.choice([[], ["a:b"], ["127.0.0.1:1", "::::"]])
    return rng.choice([None, 1, "s", [1, [2, {"k": np.arange(3)}]], {"x": np.ones(4, np.float16)}, b"raw"])


async def test_authenticated_nonsense_never_stops_the_agent():
    """A peer with the token that sends every message type with awkward values, in any order:
    the agent may refuse, fail a job or close the connection, but goes on serving."""
    import typing

    from swarm.wire import MESSAGES, Auth, Goodbye, Hello

    rng = random.Random(7)
    kinds = [cls for cls in MESSAGES.values() if cls not in (Hello, Auth, Goodbye)]
    async with swarm_of(1) as (agents, cluster):
        agent = agents[0]
        for round_ in range(20):
            conn = await connect_peer("127.0.0.1", agent.port, Credentials(f"fuzzer{round_}", TOKEN))
            try:
                for _ in range(25):
                    cls = rng.choice(kinds)
                    hints = typing.get_type_hints(cls)
                    message = cls(*(nonsense(rng, hints[name]) for name in cls.FIELDS))
                    if isinstance(message, JobData) and agent.job is not None and rng.random() < 0.5:
                        message.job_id, message.epoch = agent.job.job_id, agent.job.epoch
                    await conn.send(message)
            except Exception:  # noqa: BLE001 - the agent may close on us; that is allowed
                pass
            finally:
                await conn.aclose()
        if agent.job is not None:  # whatever a fuzzer assigned, its coordinator is gone now
            agent._release(agent.job, "test over")
        await trio.sleep(0.2)
        probe = await connect_peer("127.0.0.1", agent.port, Credentials("after", TOKEN))
        await probe.send(Ping(1))
        assert await probe.receive() == Pong(1)
        await probe.aclose()
        assert cluster.device(agent.node_id).health == "alive"


async def test_a_cancelled_jobs_thread_is_told_to_stop_and_the_job_sees_the_cancellation():
    """run_in_thread(..., stop=E): cancelling the job sets E, a long computation that looks at
    it between its pieces of work gives up, and the caller sees the cancellation (not the
    computation's own way of giving up); uncancelled, its value and its errors come back."""
    import threading

    ctx = JobContext(None, "job", 0, "test", {}, "coordinator")

    def work(stop, seconds):
        for _ in range(int(seconds / 0.02)):
            if stop.is_set():
                raise RuntimeError("gave up")
            time.sleep(0.02)
        return "done"

    stop = threading.Event()
    start = time.monotonic()
    with trio.move_on_after(0.2) as scope:
        await ctx.run_in_thread(work, stop, 20.0, stop=stop)
    assert scope.cancelled_caught and stop.is_set()
    assert time.monotonic() - start < 5  # not the 20 s the whole computation takes
    assert await ctx.run_in_thread(work, threading.Event(), 0.1, stop=threading.Event()) == "done"
    with pytest.raises(RuntimeError, match="gave up"):
        given = threading.Event()
        given.set()
        await ctx.run_in_thread(work, given, 0.1, stop=threading.Event())
