"""Job kind "bandwidth": measure latency and throughput between pairs of agents, for the profiler.

Agent side (run_bandwidth_job): waits for commands from the coordinator on channel
"probe" — {"to": node, "address": "host:port", "nbytes": N, "rounds": 3} — sends an empty
then an N-byte probe straight to that peer, `rounds` times, each acknowledged; reports the
fastest of each as {"to", "nbytes", "latency", "seconds"} on channel "probe-result".
{"done": true} ends it, and the job's result says how much of this device's time moving the
probes cost: {"comm_s_per_byte"}, the larger of the process's CPU time while the job ran
(less the work the message bursts below do between their round trips, which moves nothing)
over the probe bytes it sent and received and the CPU per byte of a burst of messages of
an activation's size (256 KiB, echoed back: smaller messages take the event loop's path,
which costs more per byte than the worker thread that moves big ones), divided by its CPU
quota where that is below one core (that CPU then comes out of the quota the computation
also runs on); and {"msg_s"}, what a
message costs beyond the latency the round trips measure. {"msg_cpu_s"}, the CPU time per
message handled (sent or received) in round trips of a small array asked for from a worker
thread that computes between them, as training's BatchNorm exchanges are, is in that latency
once, at full speed; under a quota of q cores it takes msg_cpu_s / q, so msg_s is
msg_cpu_s * (1/q - 1), and 0 without a quota. {"lane_s_per_byte", "lane_msg_s"}: what a
gradient share costs the device on a lane of its own (swarm.execution.lane), where the runs'
sums go: after each peer's probes the prober opens a lane to it and sends shares of two sizes
(LANE_SHARES) from a sending thread as a sum does, the peer receiving them in a thread; the
threads' CPU per share at each size, sent and received, gives a share's and a byte's cost
(lane_costs), each over the CPU quota. Absent where the runs sum through the event loop
(SWARM_SUM_LANES=0).

Coordinator side (measure_bandwidth): runs every ordered pair, in rounds of disjoint pairs
(`probe_rounds`): the pairs of a round probe at once, and no device is in two probes at a
time, so no two probes share a device's link or its CPU (on a switched LAN, what a probe
measures is that pair's own). It returns the measurements (each with both ends' time per
byte). Six devices take 10 rounds instead of 30 probes one after another.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time

import numpy as np
import trio

from swarm.agent.jobs import JobContext

log = logging.getLogger("swarm.profiling")

KIND = "bandwidth"
END_COSTS = ("comm_s_per_byte", "msg_s", "msg_cpu_s", "lane_s_per_byte", "lane_msg_s")  # each device's, from its job's result
DEFAULT_PROBE_BYTES = 4 * 1024 * 1024
MESSAGE_BURST = 24  # round trips per peer, timed together for the CPU a message costs
# ... with this much of the worker thread's CPU spent between them, in memory of this size: in
# training a compute thread computes a layer between two exchanges and the event loop sleeps
# meanwhile, so each message pays waking it and caches the computation took. On the testbed
# (bench/bn_exchange.py: 4 devices of 0.2 core, a group BatchNorm exchange of 3 messages out
# and 3 in) an exchange cost 1.8-2.4 ms of CPU back to back, 2.6-2.9 with 1 ms of passes over
# memory between, 2.9-3.5 with 5 ms and 3.1-4.5 with 5 ms of convolutions (bench/RESULTS.md,
# 2026-11-30 13:45); a gang member training resnet18 (one sample a member) spent about 4.6 ms
# of CPU beyond its compute an exchange.
MESSAGE_GAP_S, MESSAGE_GAP_BYTES = 0.004, 4 << 20
MESSAGE_GAPPED_PEERS = 2  # peers each device measures it with (the first it probes)
ECHO_BURST, ECHO_BYTES = 8, 256 * 1024  # echoed messages of an activation's size, for the CPU per byte
# gradient shares sent on a lane to each peer: (bytes, shares) at two sizes, for what a share
# costs beyond its bytes and what a byte costs (a sum's shares are a bucket over its group)
LANE_SHARES = ((32 * 1024, 8), (512 * 1024, 4))
LANE_TIMEOUT_S = 60.0


async def run_bandwidth_job(ctx: JobContext) -> dict:
    from swarm.agent.lane import sum_lanes_on
    from swarm.host.resources import cpu_quota

    measured = 0
    moved = [0]  # probe bytes sent and received
    per_message = []  # CPU seconds per message handled, one burst per peer
    per_byte = []  # CPU seconds per byte sent and received in messages of ECHO_BYTES, one burst per peer
    per_share: list[tuple[int, float]] = []  # (bytes, CPU seconds) of each size of share sent or received on a lane
    lanes = sum_lanes_on()
    cpu0, burst0 = time.process_time(), _bursts_cpu()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_answer_probes, ctx, moved)
        nursery.start_soon(_echo_messages, ctx)
        nursery.start_soon(_answer_lanes, ctx, per_share)
        seq = 0
        while True:
            _, command = await ctx.receive("probe")
            body = command.body
            if body.get("done"):
                nursery.cancel_scope.cancel()
                cpu = time.process_time() - cpu0 - (_bursts_cpu() - burst0)
                share = min(1.0, cpu_quota() or 1.0)
                return {"probes": measured, **link_costs(cpu, moved[0], per_byte, per_message, share),
                        **(lane_costs(per_share, share) if lanes else {})}
            peer, nbytes, rounds = body["to"], int(body["nbytes"]), int(body.get("rounds", 3))
            await ctx.connect(body["address"], peer)
            empty, full = [], []
            for _ in range(rounds):  # the fastest of a few: scheduling noise only ever adds time
                for payload, timings in ((np.zeros(0, np.uint8), empty), (np.zeros(nbytes, np.uint8), full)):
                    seq += 1
                    start = trio.current_time()
                    await ctx.send(peer, ctx.data("probe-data", {"seq": seq, "payload": payload}))
                    moved[0] += payload.nbytes
                    await _ack(ctx, peer, seq)
                    timings.append(trio.current_time() - start)
            if len(per_message) < MESSAGE_GAPPED_PEERS:
                per_message.append(await _message_burst(ctx, peer))
            echo0 = time.process_time()
            for _ in range(ECHO_BURST):  # each: ECHO_BYTES out and back, in two messages
                seq += 1
                await ctx.send(peer, ctx.data("probe-data", {"seq": seq, "payload": np.zeros(ECHO_BYTES, np.uint8),
                                                             "echo": True}))
                moved[0] += 2 * ECHO_BYTES
                await _ack(ctx, peer, seq)
            # the burst's 16 messages are in it too: a few percent of moving 4 MiB
            per_byte.append((time.process_time() - echo0) / (2 * ECHO_BURST * ECHO_BYTES))
            if lanes:
                seq += 1
                per_share += await _lane_probe(ctx, peer, body["address"], seq)
            measured += 1
            await ctx.send_to_coordinator(ctx.data("probe-result", {"to": peer, "nbytes": nbytes,
                                                                    "latency": min(empty), "seconds": min(full)}))


def link_costs(cpu: float, moved: int, per_byte: list[float], per_message: list[float], share: float) -> dict:
    """The job's result from what it measured: `cpu`, the process's CPU seconds while it ran
    less the message bursts' thread (its work between round trips is no transfer's), over the
    `moved` probe bytes, or the echoes' CPU `per_byte` where that is more; the median message's
    CPU; each over the CPU `share` where it is below a core (module docstring)."""
    msg = float(np.median(per_message)) if per_message else 0.0
    overall = max(0.0, cpu) / moved if moved else 0.0
    byte = max(overall, float(np.median(per_byte)) if per_byte else 0.0)
    return {"comm_s_per_byte": byte / share, "msg_s": msg * (1 / share - 1), "msg_cpu_s": msg}


def lane_costs(per_share: list[tuple[int, float]], share: float) -> dict:
    """{"lane_s_per_byte", "lane_msg_s"}, a byte's and a share's device time on a lane, from
    the CPU seconds of shares sent and received (`per_share`: (bytes, seconds) each), the
    median at each of the smallest and largest size making a line; each over the CPU `share`.
    Where noise puts the line's slope or its start below zero, all of the larger shares' cost
    is their bytes'.
    Empty without two sizes."""
    sizes = sorted({size for size, _ in per_share})
    if len(sizes) < 2:
        return {}
    small, large = (float(np.median([cpu for size, cpu in per_share if size == s])) for s in (sizes[0], sizes[-1]))
    byte = (large - small) / (sizes[-1] - sizes[0])
    message = small - byte * sizes[0]
    if byte <= 0 or message < 0:
        byte, message = large / sizes[-1], 0.0
    return {"lane_s_per_byte": byte / share, "lane_msg_s": message / share}


async def _lane_probe(ctx: JobContext, peer: str, address: str, seq: int) -> list[tuple[int, float]]:
    """Shares of LANE_SHARES sent to `peer` on a lane of their own, from a sending thread as a
    sum sends them; once the peer has them all (it acknowledges `seq`), [(bytes, CPU seconds a
    share)] for each size: the sending thread's and the hand-off's. A lane that fails is
    logged and measures nothing (the sums are then priced as the event loop's)."""
    from swarm.agent.lane import Lane, LaneBroken
    from swarm.errors import SwarmError
    from swarm.net import ConnectionLost

    try:
        conn = await ctx.open_lane(address, peer, {"seq": seq})
    except (ConnectionLost, SwarmError, OSError) as exc:
        log.warning("cannot open a lane to %s to probe it: %s", peer, exc)
        return []
    lane = Lane(conn, peer, ctx.job_id, ctx.epoch)
    try:
        costs = await trio.to_thread.run_sync(_send_shares, lane)
        with trio.fail_after(LANE_TIMEOUT_S):
            await _ack(ctx, peer, seq)
    except (LaneBroken, TimeoutError, trio.TooSlowError) as exc:
        log.warning("a lane probe to %s failed: %s", peer, exc)
        return []
    finally:
        lane.shutdown()
        lane.sock.close()
        with trio.CancelScope(shield=True):
            await conn.aclose("probed")
    return costs


def _send_shares(lane) -> list[tuple[int, float]]:
    from concurrent.futures import ThreadPoolExecutor

    def send(key, share) -> float:
        start = time.thread_time()
        lane.send(key, share, LANE_TIMEOUT_S)
        return time.thread_time() - start

    costs, spent = [], 0.0
    with ThreadPoolExecutor(1, thread_name_prefix="lane-probe") as sender:
        for n, (nbytes, count) in enumerate(LANE_SHARES):
            share = np.ones(nbytes // 4, np.float32)
            own0 = time.thread_time()
            sent = sum(sender.submit(send, ["probe", n, i], share).result() for i in range(count))
            cpu = sent + time.thread_time() - own0
            costs += [(nbytes, cpu / count)]
            spent += cpu
    _count_burst(spent)
    return costs


async def _answer_lanes(ctx: JobContext, per_share: list[tuple[int, float]]) -> None:
    """The far end of _lane_probe: each lane's shares received in a thread, their CPU a share
    kept (unless the lane failed, which is logged), the lane closed, the prober told."""
    from swarm.agent.jobs import LANE
    from swarm.agent.lane import Lane, LaneBroken

    while True:
        sender, (body, conn) = await ctx.receive(LANE)
        lane = Lane(conn, sender, ctx.job_id, ctx.epoch)
        try:
            per_share += await trio.to_thread.run_sync(_receive_shares, lane)
        except (LaneBroken, TimeoutError) as exc:
            log.warning("a lane probe from %s failed: %s", sender, exc)
        finally:
            lane.shutdown()
            lane.sock.close()
            with trio.CancelScope(shield=True):
                await conn.aclose("probed")
        await ctx.send(sender, ctx.data("probe-ack", {"seq": body.get("seq")}))  # (the prober goes on either way)


def _receive_shares(lane) -> list[tuple[int, float]]:
    costs, spent = [], 0.0
    for n, (nbytes, count) in enumerate(LANE_SHARES):
        like = np.empty(nbytes // 4, np.float32)
        start = time.thread_time()
        for i in range(count):
            lane.receive(["probe", n, i], like, LANE_TIMEOUT_S)
        cpu = time.thread_time() - start
        costs += [(nbytes, cpu / count)]
        spent += cpu
    _count_burst(spent)
    return costs


_BURSTS = {"cpu": 0.0, "lock": threading.Lock()}


def _bursts_cpu() -> float:
    """CPU seconds the threads of every message burst and lane probe in this process have used
    so far (an agent's own, and where several agents share a process, as in tests, theirs too):
    none of it moves the probe bytes the CPU per byte is over."""
    with _BURSTS["lock"]:
        return _BURSTS["cpu"]


def _count_burst(cpu: float) -> None:
    with _BURSTS["lock"]:
        _BURSTS["cpu"] += cpu


async def _message_burst(ctx: JobContext, peer: str) -> float:
    """CPU seconds per message handled, along the path training takes: a worker thread (as a
    compute thread does for a BatchNorm exchange) has the event loop send a small array and
    waits for the peer's answer, then works MESSAGE_GAP_S of its own CPU time through
    MESSAGE_GAP_BYTES before the next. Each round trip is one message out and one in,
    MESSAGE_BURST of them timed together, less the work between. The thread's own CPU is
    counted in _bursts_cpu. (No torch here: a transport job must not stall the event loop
    importing it.)"""
    token = trio.lowlevel.current_trio_token()
    stats = np.zeros((2, 256))  # a BatchNorm layer's sums
    memory = np.ones(MESSAGE_GAP_BYTES // 8)

    def work() -> float:
        start = time.thread_time()
        while time.thread_time() - start < MESSAGE_GAP_S:
            np.multiply(memory, 1.0, out=memory)
        return time.thread_time() - start

    async def exchange(k: int) -> None:
        await ctx.send(peer, ctx.data("probe-x", {"k": ["echo", k], "p": {"arrays": [stats]}}))
        while True:
            sender, reply = await ctx.receive("probe-x-back")
            if sender == peer and reply.body["k"] == ["echo", k]:
                return

    def burst() -> float:
        own0 = time.thread_time()
        trio.from_thread.run(exchange, -1, trio_token=token)  # warm
        cpu0, worked = time.process_time(), 0.0
        for k in range(MESSAGE_BURST):
            worked += work()
            trio.from_thread.run(exchange, k, trio_token=token)
        per_message = max(0.0, time.process_time() - cpu0 - worked) / (2 * MESSAGE_BURST)
        _count_burst(time.thread_time() - own0)
        return per_message

    return await trio.to_thread.run_sync(burst)


async def _echo_messages(ctx: JobContext) -> None:
    """The other end of _message_burst: each message straight back to its sender."""
    while True:
        sender, message = await ctx.receive("probe-x")
        body = message.body
        await ctx.send(sender, ctx.data("probe-x-back", {"k": body["k"], "p": body["p"]}))


async def _ack(ctx: JobContext, peer: str, seq: int) -> None:
    while True:
        sender, ack = await ctx.receive("probe-ack")
        if sender == peer and ack.body["seq"] == seq:
            return


async def _answer_probes(ctx: JobContext, moved: list[int]) -> None:
    while True:
        sender, probe = await ctx.receive("probe-data")
        moved[0] += probe.body["payload"].nbytes
        echo = {"payload": probe.body["payload"]} if probe.body.get("echo") else {}
        await ctx.send(sender, ctx.data("probe-ack", {"seq": probe.body["seq"], **echo}))


async def measure_bandwidth(cluster, node_ids: list[str], *, nbytes: int = DEFAULT_PROBE_BYTES,
                            timeout: float = 60.0) -> dict[tuple[str, str], dict]:
    """{(sender, receiver): {"bytes_per_second", "latency", "seconds", "nbytes", and for each
    of END_COSTS {"from", "to"}: the two ends' figures}} for every ordered pair of `node_ids` (devices of `cluster`, alive)."""
    job = cluster.job(f"bandwidth-{secrets.token_hex(4)}", 0)
    results: dict[tuple[str, str], dict] = {}
    try:
        await job.assign_and_start(KIND, {node: {} for node in node_ids}, all_or_raise=True)
        for pairs in probe_rounds(node_ids):
            for src, dst in pairs:
                device = cluster.device(dst)
                await job.send(src, job.data("probe", {"to": dst, "address": f"{device.address}:{device.port}",
                                                       "nbytes": nbytes}))
            with trio.fail_after(timeout):
                for _ in pairs:
                    src, reply = await job.receive("probe-result")
                    r = reply.body
                    transfer = r["seconds"] - r["latency"] if r["seconds"] > 2 * r["latency"] else r["seconds"]
                    results[(src, r["to"])] = {"nbytes": r["nbytes"], "seconds": r["seconds"],
                                               "latency": r["latency"], "bytes_per_second": r["nbytes"] / transfer}
        for node in node_ids:
            await job.send(node, job.data("probe", {"done": True}))
        ends = {}
        for node in node_ids:
            with trio.fail_after(timeout):
                done = await job.wait_done(node) or {}
            ends[node] = {k: float(done.get(k, 0.0)) for k in END_COSTS}
        for (src, dst), r in results.items():
            for k in END_COSTS:
                r[k] = {"from": ends[src][k], "to": ends[dst][k]}
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await job.release_all()
    return results


def probe_rounds(nodes: list[str]) -> list[list[tuple[str, str]]]:
    """Every ordered pair of `nodes` once, in rounds of pairs that share no node: the circle
    method's n - 1 matchings (n rounded up to even, the odd one out resting), each in one
    direction and then the other, 2(n - 1) rounds in all."""
    ring: list[str | None] = list(nodes) + ([None] if len(nodes) % 2 else [])
    n = len(ring)
    rounds = []
    for _ in range(n - 1):
        pairs = [(a, b) for a, b in zip(ring[:n // 2], reversed(ring[n // 2:])) if a is not None and b is not None]
        rounds += [pairs, [(b, a) for a, b in pairs]]
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return [pairs for pairs in rounds if pairs]
