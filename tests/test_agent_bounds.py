"""What a hostile neighbour or a misbehaving token holder can make an agent hold is bounded:
handshakes in progress, messages waiting for their job (count, bytes, age), replies to a peer
that does not read, and log lines. The first tests are pure or in one trio loop; the last
ones flood a real `swarm join` subprocess whose descriptors are capped at 1024."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import pytest
import trio

from swarm import limits
from swarm.agent import Agent, AgentConfig
from swarm.agent.early import held_bytes
from swarm.cluster import open_roster
from swarm.net import ConnectionLost, Credentials, PeerConnection, connect_peer, resolve_network, serve_peers
from swarm.net.gate import HandshakeGate
from swarm.net.peer import _accept_loop
from swarm.net.ratelimit import LogLimiter
from swarm.wire import CLIENT, Connection, InfoRequest, JobAssign, JobData, JobStart, Ping, Pong
from swarm.wire.frames import LENGTH
from tests.conftest import ROOT

TOKEN = "test-token-" + "x" * 24
MiB = 1 << 20


# -- the pure parts ---------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_log_limiter_logs_the_first_line_then_one_per_interval_with_a_count(caplog):
    caplog.set_level(logging.INFO, logger="test.limiter")
    clock = FakeClock()
    lines = LogLimiter(logging.getLogger("test.limiter"), interval=1.0, clock=clock)
    for i in range(1000):
        lines.log(logging.WARNING, "unknown job", "refused job %s", i)
    lines.log(logging.WARNING, "other", "something else")
    assert [r.getMessage() for r in caplog.records] == ["refused job 0", "something else"]
    assert lines.held("unknown job") == 999
    clock.now = 0.5
    lines.flush()                                   # the interval is not over: nothing yet
    assert len(caplog.records) == 2
    clock.now = 1.0
    lines.flush()
    assert caplog.records[-1].getMessage() == "refused job 999 (998 more like it in the last 1.0 s)"
    clock.now = 1.5
    lines.log(logging.WARNING, "unknown job", "refused job %s", "a")   # held: a line went out at 1.0
    clock.now = 2.5
    lines.log(logging.WARNING, "unknown job", "refused job %s", "b")
    assert caplog.records[-1].getMessage() == "refused job b (1 more like it in the last 1.5 s)"
    assert len(caplog.records) == 4 and all(r.exc_info is None for r in caplog.records)


def test_gate_caps_handshakes_overall_and_per_host():
    gate = HandshakeGate(total=5, per_host=3, hello_grace=10.0)
    a = [gate.admit("10.0.0.1", 0.0)[0] for _ in range(4)]
    assert a[3] is None and all(a[:3])                         # the fourth from one host
    b = [gate.admit("10.0.0.2", 1.0)[0] for _ in range(3)]
    assert b[2] is None and all(b[:2])                         # the sixth in all
    assert gate.in_progress == 5 and gate.in_progress_from("10.0.0.1") == 3
    gate.release(a[0])
    gate.release(a[0])                                         # twice is harmless
    c, evicted = gate.admit("10.0.0.3", 2.0)
    assert gate.in_progress == 5 and c is not None and evicted is None
    assert gate.take_refusals() == (2, [("10.0.0.1", 1), ("10.0.0.2", 1)], 0)
    assert gate.take_refusals() == (0, [], 0)
    # Hellos come due in order of admission, each once; released tickets never
    assert gate.next_hello_admitted_at() == 0.0
    assert gate.hello_due(0.5) == a[1:3]
    assert gate.hello_due(0.5) == [] and gate.next_hello_admitted_at() == 1.0
    assert gate.hello_due(5.0) == [*b[:2], c]
    assert gate.next_hello_admitted_at() is None


class HelloSeen:
    peer_id = "someone"


def test_gate_makes_room_by_ending_the_oldest_handshake_without_a_hello():
    gate = HandshakeGate(total=4, per_host=2, hello_grace=0.5)
    a0, _ = gate.admit("10.0.0.1", 0.0)
    a1, _ = gate.admit("10.0.0.1", 0.1)
    a0.conn = HelloSeen()                                      # its Hello came: it keeps its place
    assert gate.admit("10.0.0.1", 0.5) == (None, None)         # a1 has not had its grace yet
    a2, evicted = gate.admit("10.0.0.1", 0.7)
    assert evicted is a1 and a1.evicted and a2 is not None and gate.in_progress_from("10.0.0.1") == 2
    gate.release(a1)                                           # its task ends later: nothing changes
    assert gate.in_progress == 2
    b = [gate.admit("10.0.0.2", 0.8)[0] for _ in range(2)]
    c, evicted = gate.admit("10.0.0.3", 1.2)                   # over the total: the oldest idle of any host
    assert c is not None and evicted is a2
    assert gate.admit("10.0.0.3", 1.2) == (None, None)         # b's are not idle for long enough
    assert gate.take_refusals() == (2, [("10.0.0.1", 1), ("10.0.0.3", 1)], 2)
    assert gate.in_progress == 4 and set(gate._tickets) == {a0, *b, c}


def test_gate_counts_refusals_of_at_most_a_few_hosts_one_by_one():
    gate = HandshakeGate(total=0, per_host=0)
    for i in range(1000):
        gate.admit(f"10.0.{i // 250}.{i % 250}", 0.0)
    count, hosts, evicted = gate.take_refusals()
    assert count == 1000 and len(hosts) == limits.REFUSAL_HOSTS and evicted == 0


def test_held_bytes_counts_tensors_strings_and_values():
    body = {"x": np.zeros((256, 1024), np.float32), "parts": [np.ones(10, np.uint8), "abc", 3]}
    message = JobData("j" * 40, 0, "in", body)
    nbytes = held_bytes(message)
    assert 1 * MiB + 10 + 40 + 3 < nbytes < 1 * MiB + 10 + 40 + 3 + 2048


# -- in one trio loop -----------------------------------------------------------------------------

@dataclass
class Served:
    port: int
    gate: HandshakeGate


async def raw_connection(port: int, source: str = "127.0.0.1") -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port, local_address=source)


async def closed_by_peer(stream: trio.SocketStream, within: float) -> bool:
    """Whether the other side closes `stream` within `within` seconds (reads nothing else)."""
    with trio.move_on_after(within):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


@pytest.mark.trio
async def test_connections_over_the_caps_are_closed_at_once_and_counted_once_a_second(caplog):
    caplog.set_level(logging.INFO, logger="swarm")
    gate = HandshakeGate(total=8, per_host=4, hello_grace=10.0)

    async def handler(conn):
        async for message in conn:
            if isinstance(message, Ping):
                await conn.send(Pong(message.seq))

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_peers, handler, Credentials("server", TOKEN), ["127.0.0.1"], 0,
                                               hello_timeout=1.0, gate=gate))
            # 20 silent connections from one neighbour: 4 wait for their Hello, 16 are closed at once
            streams = [await raw_connection(port, "127.0.0.2") for _ in range(20)]
            await trio.sleep(0.05)
            assert gate.in_progress == 4 and gate.in_progress_from("127.0.0.2") == 4
            refused = [await closed_by_peer(s, 0.05) for s in streams]
            assert sum(refused) == 16 and not any(refused[:4])
            # three more hosts fill the overall cap of 8; another host is then refused too
            for source in ("127.0.0.3", "127.0.0.4"):
                streams += [await raw_connection(port, source) for _ in range(2)]
            await trio.sleep(0.05)
            assert gate.in_progress == 8
            late = await raw_connection(port, "127.0.0.5")
            assert await closed_by_peer(late, 0.5)
            # the Hello deadline frees every slot; then a real peer gets in at once
            assert all([await closed_by_peer(s, 1.0) for s in streams[:4] + streams[20:]])
            await trio.sleep(0.1)
            assert gate.in_progress == 0
            conn = await connect_peer("127.0.0.1", port, Credentials("client", TOKEN), timeout=1)
            await conn.send(Ping(1))
            assert await conn.receive() == Pong(1)
            await conn.aclose()
            await trio.sleep(1.1)  # the refusal report comes once a second
            for stream in streams + [late]:
                await stream.aclose()
            nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    report = [m for m in messages if "too many handshakes in progress" in m]
    assert 1 <= len(report) <= 2, messages  # one line a second
    assert sum(int(re.match(r"refused (\d+) connections? in the last 1 s: ", m).group(1)) for m in report) == 17
    assert "(8 at most, 4 from one host; from 127.0.0.2: 16" in report[0], report
    no_hello = [m for m in messages if "no Hello within 1 s" in m]
    assert 1 <= len(no_hello) <= 2, messages  # 8 of them, one line and the rest counted
    assert all(r.exc_info is None for r in caplog.records)


class FailingListener:
    """A listener whose accept() fails with EMFILE `failures` times, then waits for ever."""

    def __init__(self, failures: int):
        self.failures = failures

    async def accept(self):
        await trio.lowlevel.checkpoint()
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        await trio.sleep_forever()


@pytest.mark.trio
async def test_out_of_descriptors_on_accept_is_one_line_without_a_traceback(caplog, autojump_clock):
    caplog.set_level(logging.INFO)
    listener = FailingListener(50)
    lines = LogLimiter(logging.getLogger("swarm.net"), clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_accept_loop, listener, HandshakeGate(), nursery, None, 5.0, lines, 4750)
        await trio.sleep(50 * limits.ACCEPT_RETRY + 1)
        assert listener.failures == 0
        lines.flush()
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if "accept" in r.getMessage()]
    first = "cannot accept connections on port 4750: EMFILE (Too many open files); trying again every 0.1 s"
    assert lines[0] == first and all(re.fullmatch(re.escape(first) + r" \(\d+ more like it in the last 1\.\d s\)", line)
                                     for line in lines[1:]), lines
    assert 5 <= len(lines) <= 7 and all(r.exc_info is None for r in caplog.records)  # 50 failures over 5 s
    assert not [r for r in caplog.records if r.name.startswith("trio")]


async def one_agent(nursery, **config) -> Agent:
    agent_config = AgentConfig(name="a", node_id="node-a", token=TOKEN, network=resolve_network("lo"), port=0,
                               advertise=False, **config)
    return await nursery.start(Agent(agent_config).run)


async def round_trip(conn: PeerConnection, seq: int) -> None:
    """Everything sent on `conn` before this has been dispatched by the agent."""
    await conn.send(Ping(seq))
    while True:
        message = await conn.receive()
        if message == Pong(seq):
            return


@pytest.mark.trio
async def test_early_messages_are_bounded_by_bytes_and_dropped_when_old(caplog):
    caplog.set_level(logging.INFO, logger="swarm")
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            agent = await one_agent(nursery, early_bytes=1 * MiB, early_age=0.6)
            conn = await connect_peer("127.0.0.1", agent.port, Credentials("sender", TOKEN))
            x = np.zeros(64 * 1024, np.float32)  # 256 KiB
            for i in range(10):
                await conn.send(JobData(f"ghost-{i}", 0, "in", {"x": x}))
            await round_trip(conn, 1)
            count, nbytes = agent.early
            assert count == 3 and 3 * 256 * 1024 < nbytes <= 1 * MiB   # a fourth would go over 1 MiB
            assert agent.refused_messages == 7
            await trio.sleep(0.6 + 0.3)                                 # the sweep drops them
            assert agent.early == (0, 0) and agent.expired_messages == 3
            # room again
            await conn.send(JobData("ghost-10", 0, "in", {"x": x}))
            await round_trip(conn, 2)
            assert agent.early[0] == 1
            await conn.aclose()
            nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert any("refused JobData of job ghost-3 epoch 0 from node sender: its 0.3 MiB would take the messages "
               "waiting for an assignment over 1 MiB" in m for m in messages), messages
    assert sum("refused JobData" in m for m in messages) <= 2
    assert any(re.match(r"dropped [123] messages? \(0\.\d MiB\) that waited more than 0\.6 s for their job", m)
               for m in messages), messages  # all three at once, or one by one (the rest in a later line)


@pytest.mark.trio
async def test_lanes_for_jobs_not_here_are_held_up_to_a_bound_and_closed_when_old():
    """A lane's hello (swarm/execution/lane.py) for a job not assigned yet holds its connection
    open: at most EARLY_LANES of them, each for early_age; one more is closed at once."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            agent = await one_agent(nursery, early_age=1.0)
            lanes = []
            for i in range(limits.EARLY_LANES + 1):
                conn = await connect_peer("127.0.0.1", agent.port, Credentials(f"sender-{i}", TOKEN))
                await conn.send(JobData("not-yet", 0, "lane", {"from": f"d{i}", "stage": 0}))
                lanes.append(conn)
            with trio.fail_after(2):  # the one over the bound: closed at once
                with pytest.raises(ConnectionLost):
                    await lanes[-1].receive()
            assert len(agent._early_lanes) == limits.EARLY_LANES and not any(c.closed for c in lanes[:-1])
            await trio.sleep(1.0 + 0.5)  # the sweep closes the rest
            assert agent._early_lanes == []
            for conn in lanes[:-1]:
                with trio.fail_after(2):
                    with pytest.raises(ConnectionLost):
                        await conn.receive()
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_flood_of_unknown_job_ids_makes_a_few_log_lines_a_second(caplog):
    caplog.set_level(logging.DEBUG, logger="swarm")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            agent = await one_agent(nursery)
            conn = await connect_peer("127.0.0.1", agent.port, Credentials("flooder", TOKEN))
            started = trio.current_time()
            before = len(caplog.records)
            for i in range(5000):
                await conn.send(JobData(f"nobody-asked-for-{i}", i, "in", None))
            await round_trip(conn, 1)
            elapsed = trio.current_time() - started
            lines = caplog.records[before:]
            assert agent.early[0] == limits.EARLY_MESSAGES and agent.refused_messages == 5000 - limits.EARLY_MESSAGES
            assert len(lines) <= 2 + 2 * elapsed, [r.getMessage() for r in lines]
            await conn.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_replies_never_carry_a_megabyte_long_job_id_back():
    """Replies are bounded by count in the outbox; each stays small because no reply echoes a
    job id longer than any job may have."""
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            agent = await one_agent(nursery)
            conn = await connect_peer("127.0.0.1", agent.port, Credentials("echo", TOKEN))
            await conn.send(JobStart("j" * MiB, 0))                          # ignored: no job has such an id
            await conn.send(JobAssign("k" * MiB, 0, "bandwidth", {}, 0.1))  # refused, the id cut short
            await conn.send(Ping(1))
            replies = []
            while (message := await conn.receive()) != Pong(1):
                replies.append(message)
            assert [(type(r).__name__, len(r.job_id), r.state) for r in replies] == [("JobState", 128, "refused")]
            await conn.aclose()
            nursery.cancel_scope.cancel()


# -- a real agent subprocess, its descriptors capped at 1024 ------------------------------------

LAUNCHER = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
import swarm.limits
for name, value in json.loads(sys.argv[1]).items():
    setattr(swarm.limits, name, value)
from swarm.cli import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass
class RealAgent:
    proc: subprocess.Popen
    port: int
    token: str
    log_path: Path

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def log(self) -> str:
        return self.log_path.read_text()


@contextmanager
def real_agent(tmp_path: Path, **limit_overrides):
    """`swarm join` (no mDNS, loopback only) with RLIMIT_NOFILE 1024 and the given swarm.limits."""
    env = {k: v for k, v in os.environ.items() if k not in ("SWARM_TOKEN", "SWARM_TOKEN_FILE")}
    env.update(PYTHONPATH=str(ROOT), SWARM_INTERFACE="lo", SWARM_PEERS="")
    state, log_path = tmp_path / "state", tmp_path / "agent.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(limit_overrides), "join", "--port", "0",
                                 "--no-mdns", "--interface", "lo", "--state-dir", str(state), "--name", "bounds"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"listening on \S+ port (\d+)", log_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        assert psutil.Process(proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (1024, 1024)
        yield RealAgent(proc, int(found.group(1)), (state / "token").read_text().strip(), log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def many_descriptors():
    """This process may open a few thousand sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def half_open(port: int, source: str, partial_hello: bool) -> socket.socket:
    """A TCP connection that never completes a Hello: silent, or the first bytes of a frame."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    if partial_hello:
        sock.sendall(LENGTH.pack(120) + b"\x95\x01")
    return sock


async def status_finds(agent: RealAgent, timeout: float = 3.0) -> float:
    """What `swarm status --no-mdns --peers 127.0.0.1:PORT --expect 1 --wait 3` does; seconds until it
    found the device alive (AssertionError if it does not within `timeout`)."""
    started = trio.current_time()
    async with open_roster(Credentials(f"status-{time.monotonic_ns()}", agent.token), resolve_network("lo"),
                            peers=[("127.0.0.1", agent.port)], discover=False) as cluster:
        devices = await cluster.wait_for(1, timeout)
        assert [d.name for d in devices] == ["bounds"] and devices[0].health == "alive"
    return trio.current_time() - started


@pytest.mark.trio
async def test_half_open_flood_leaves_the_agent_answering_status(tmp_path, many_descriptors):
    with real_agent(tmp_path) as agent:
        idle_fds = agent.process.num_fds()
        flood, most_fds = [], 0
        try:
            for i in range(1200):  # from two hosts, half of them with the start of a Hello
                flood.append(half_open(agent.port, "127.0.0.1" if i % 2 else "127.0.0.2", partial_hello=i % 4 < 2))
                if i % 100 == 99:
                    most_fds = max(most_fds, agent.process.num_fds())
            took = [await status_finds(agent) for _ in range(10)]  # while the flood's sockets stay open
            most_fds = max(most_fds, agent.process.num_fds())
            await trio.sleep(limits.LOG_INTERVAL + 0.2)  # for the last report
        finally:
            for sock in flood:
                sock.close()
        log = agent.log()
    print(f"agent descriptors: {idle_fds} idle, at most {most_fds} during the flood; "
          f"status found it in {', '.join(f'{t:.2f}' for t in took)} s")
    assert most_fds <= idle_fds + 2 * limits.HANDSHAKES_PER_HOST + 16
    assert "Traceback" not in log and "EMFILE" not in log, log[-3000:]
    reports = re.findall(r"refused (\d+) connections in the last 1 s: too many handshakes in progress", log)
    assert reports and sum(map(int, reports)) >= 1200 - 2 * limits.HANDSHAKES_PER_HOST, log[-3000:]


@pytest.mark.trio
async def test_early_message_flood_stays_within_the_budget_and_expires(tmp_path):
    age = 3.0
    with real_agent(tmp_path, EARLY_AGE=age) as agent:
        idle = agent.rss()
        conn = await connect_peer("127.0.0.1", agent.port, Credentials("flooder", agent.token))
        x = np.ones(MiB // 4, np.float32)
        for i in range(1100):
            await conn.send(JobData(f"never-assigned-{i}", 0, "in", {"x": x}))
        await round_trip(conn, 1)
        full = agent.rss()
        # counted from the flood's end, not its start: on a loaded host sending it took long
        # enough that its last messages had not waited `age` yet when the RSS was read again
        await trio.sleep(age + 1.5)
        after = agent.rss()
        # the budget is free again: another flood is held, not refused
        for i in range(100):
            await conn.send(JobData(f"later-{i}", 0, "in", {"x": x}))
        await round_trip(conn, 2)
        again = agent.rss()
        await conn.aclose()
        log = agent.log()
    print(f"agent RSS: {idle / MiB:.0f} MiB idle, {full / MiB:.0f} MiB holding the flood, "
          f"{after / MiB:.0f} MiB after it expired, {again / MiB:.0f} MiB holding 100 more")
    assert full <= limits.EARLY_BYTES + 64 * MiB
    assert re.search(r"dropped \d+ messages \(\d+\.\d MiB\) that waited more than 3 s for their job", log), log
    refused = re.findall(r"refused JobData of job (\S+) epoch 0 from node flooder: its 1\.0 MiB would take", log)
    assert refused and all(job.startswith("never-assigned-") for job in refused)  # none of the later ones
    assert len(re.findall(r"refused JobData", log)) <= 2 + 2 * (age + 3), log[-3000:]
    assert again <= limits.EARLY_BYTES + 64 * MiB
    assert after < full  # malloc gave the dropped messages' memory back
    assert "Traceback" not in log


@pytest.mark.trio
async def test_a_peer_that_never_reads_is_disconnected(tmp_path):
    with real_agent(tmp_path) as agent:
        idle = agent.rss()
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        await sock.connect(("127.0.0.1", agent.port))
        conn = PeerConnection(trio.SocketStream(sock), Connection(CLIENT, "deaf", agent.token), "agent")
        await conn.handshake()
        sent = 0
        try:
            with trio.move_on_after(15) as waited:
                try:
                    while True:  # requests that each get a reply, never read
                        await conn.send(InfoRequest())
                        sent += 1
                        if sent % 200 == 0:
                            await trio.sleep(0.01)  # let the agent's end of it show through
                except ConnectionLost:
                    pass
        finally:
            await conn.aclose()
            await trio.aclose_forcefully(conn.stream)  # aclose() leaves it to the GC once a send broke
        most = agent.rss()
        log = agent.log()
    print(f"agent RSS: {idle / MiB:.0f} MiB idle, {most / MiB:.0f} MiB after {sent} unread requests")
    assert not waited.cancelled_caught, f"still connected after {sent} requests"
    assert re.search(rf"disconnected 127\.0\.0\.1:\d+ \(node deaf\): it left {limits.OUTBOX} replies unread", log)
    assert "Traceback" not in log
    assert most - idle < 32 * MiB
