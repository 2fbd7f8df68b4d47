"""Gradient sums on lanes of their own (swarm/execution/lane.py), between real agents in one
trio loop on 127.0.0.1: the same bits as the event loop's direct sum, lanes that come before
their job is assigned, a tampered or mislabelled share reported as a broken link, and a lane
its far end closed waited on, unreported."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import trio

from swarm.agent import register_job_kind
from swarm.cluster import JobError
from swarm.execution.collectives import allreduce_sum, chunk_bounds
from swarm.execution.endpoint import LocalNetwork
from swarm.execution.lane import LANE, SumLanes
from tests.test_agent import swarm_of

pytestmark = pytest.mark.trio

# a bucket whose shares take several sealed records and wake the receiver only once most of
# one is in (SO_RCVLOWAT), then smaller ones; the last has fewer elements than members, so
# some of its chunks are empty
SIZES = [300_000, 1000, 7, 2]


def share(step: int, bucket: int, member: int, size: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng([step, bucket, member]).standard_normal(size).astype(dtype)


async def lane_job(ctx) -> dict:
    """Sum SIZES' shares over the group on lanes, `steps` times; what came back, as bytes."""
    spec = ctx.spec
    group = spec["group"]
    me = next(name for name, d in spec["devices"].items() if d["node_id"] == ctx.node_id)
    reports: list = []

    async def report(name: str, why: str) -> None:
        reports.append([name, why])

    lanes = SumLanes(me, spec["devices"], ctx.job_id, ctx.epoch, ctx.open_lane, lambda: ctx.receive(LANE), report)
    sums, finished, sent = [], False, [0]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lanes.pump)
            with trio.move_on_after(spec.get("wait", 20)):
                if spec.get("close_at_once") == me:
                    await lanes._ready(0, group, 10)
                    await lanes.aclose()
                    await trio.sleep_forever()
                if spec.get("idle") == me:
                    await lanes._ready(0, group, 10)
                    await trio.sleep_forever()
                if spec.get("tamper") == me:
                    await lanes._ready(0, group, 10)
                    for (_, far), lane in lanes.out.items():
                        lane.send = tampered(lane)
                if spec.get("weights"):  # count the elements this member sends
                    await lanes._ready(0, group, 10)
                    for lane in lanes.out.values():
                        lane.send = counted(lane.send, sent)
                for step in range(spec["steps"]):
                    for bucket, size in enumerate(SIZES):
                        flat = torch.from_numpy(share(step, bucket, group.index(me), size, np.dtype(spec["dtype"])))
                        label = step + 1 if spec.get("mislabel") == me else step
                        await lanes.allreduce(0, group, ("grads", label, 0, bucket), flat, spec.get("timeout", 30),
                                              spec.get("weights"))
                        sums.append(flat.numpy().tobytes())
                finished = True
            nursery.cancel_scope.cancel()
    finally:
        await lanes.aclose()
    counts = {"sent": sent[0]} if spec.get("weights") else {}  # (elements this member sent)
    return {"sums": sums, "reports": reports, "finished": finished, **counts}


def counted(send, sent: list[int]):
    def counting(key, array, timeout) -> None:
        sent[0] += array.size
        send(key, array, timeout)
    return counting


def tampered(lane):
    """The lane's send with one byte of each sealed record's ciphertext flipped on the way."""
    from swarm.wire import JobData

    def send(key, array, timeout) -> None:
        lane.protocol.send(JobData(lane.job_id, lane.epoch, LANE, {"k": key, "arrays": [array]}))
        lane.sock.settimeout(timeout)
        for buffer in lane.protocol.data_to_send():
            data = bytearray(buffer)
            if len(data) > 40:
                data[len(data) // 2] ^= 0x01
            lane.sock.sendall(bytes(data))
    return send


@pytest.fixture(scope="module")
def kind():
    name = f"lane-test-{random.randrange(10**9)}"
    register_job_kind(name, lane_job)
    return name


async def run_lane_job(kind: str, n: int, stagger: float = 0.0, **spec) -> list[dict]:
    """The job on n agents, started last member first, `stagger` seconds apart (a lane may
    then reach an agent before its assignment); each member's result, in group order."""
    async with swarm_of(n) as (agents, cluster):
        devices = {a.config.name: {"node_id": a.node_id, "address": f"127.0.0.1:{a.port}"} for a in agents}
        group = [a.config.name for a in agents]
        job = cluster.job("lanes", epoch=0)
        spec = {"devices": devices, "group": group, "steps": 2, "dtype": "float32", **spec}
        for agent in reversed(agents):
            await job.assign(agent.node_id, kind, spec)
            await job.start(agent.node_id)
            await trio.sleep(stagger)
        results = []
        with trio.fail_after(60):
            for agent in agents:
                try:
                    results.append(await job.wait_done(agent.node_id))
                except JobError as exc:
                    results.append({"error": str(exc)})
        return results


async def direct_sums(n: int, steps: int, dtype, weights: list[int] | None = None) -> list[list[bytes]]:
    """What collectives.allreduce_sum gives each member (over the in-process network)."""
    network = LocalNetwork()
    endpoints = [network.endpoint(f"a{i}") for i in range(n)]
    out: list[list[bytes]] = [[] for _ in range(n)]
    for step in range(steps):
        for bucket, size in enumerate(SIZES):
            flats = [torch.from_numpy(share(step, bucket, i, size, dtype)) for i in range(n)]
            async with trio.open_nursery() as nursery:
                for i, ep in enumerate(endpoints):
                    nursery.start_soon(allreduce_sum, ep, [e.name for e in endpoints], ("grads", step, 0, bucket),
                                       flats[i], math.inf, weights)
            for i in range(n):
                out[i].append(flats[i].numpy().tobytes())
    return out


@pytest.mark.parametrize("n, dtype", [(3, "float32"), (4, "float64")])
async def test_sums_on_lanes_are_the_direct_sums_bits(kind, n, dtype):
    results = await run_lane_job(kind, n, stagger=0.2, dtype=dtype)
    assert all(r["finished"] and r["reports"] == [] for r in results)
    expected = await direct_sums(n, 2, np.dtype(dtype))
    assert [r["sums"] for r in results] == expected
    assert len({tuple(r["sums"]) for r in results}) == 1  # every member holds the same bits


async def test_sums_on_lanes_with_chunks_by_each_members_samples_are_the_equal_chunks_bits(kind):
    """Members that own chunks of other sizes (Stage.sum_weights: 12, 2 and 4 samples a step) sum
    the same bits on lanes as the event loop's direct sum with equal chunks."""
    weights = [12, 2, 4]
    results = await run_lane_job(kind, 3, weights=weights)
    assert all(r["finished"] and r["reports"] == [] for r in results)
    assert [r["sums"] for r in results] == await direct_sums(3, 2, np.dtype("float32"))
    # member j sends S - c_j of its gradient and its summed chunk c_j to the 2 others
    chunks = [[hi - lo for lo, hi in zip(b, b[1:])] for b in (chunk_bounds(size, 3, weights) for size in SIZES)]
    assert [r["sent"] for r in results] == [2 * sum(size - c[j] + 2 * c[j] for size, c in zip(SIZES, chunks))
                                            for j in range(3)]


async def test_a_tampered_share_breaks_the_lane_and_names_its_sender(kind):
    results = await run_lane_job(kind, 3, tamper="a1", wait=3)
    assert not any(r["finished"] for r in results)
    reported = [r["reports"] for r in results]
    assert reported[1] == []  # (what a1 receives is sound)
    for reports in (reported[0], reported[2]):  # a1 sends to both; each names it, once
        assert len(reports) == 1 and reports[0][0] == "a1" and "refused what came" in reports[0][1]


async def test_a_share_of_another_step_is_refused_and_reported(kind):
    results = await run_lane_job(kind, 2, mislabel="a0", wait=3)
    assert not any(r["finished"] for r in results)
    assert results[0]["reports"][0][0] == "a1" and results[1]["reports"][0][0] == "a0"
    assert "expected share ['grads', 0, 0, 0, 'ds', 0]" in results[1]["reports"][0][1]


async def test_a_lane_its_far_end_closed_is_waited_on_unreported(kind):
    results = await run_lane_job(kind, 3, close_at_once="a2", wait=2)
    assert not any(r["finished"] for r in results)
    assert all(r["reports"] == [] for r in results)


async def test_a_share_that_does_not_come_in_time_is_too_slow(kind):
    results = await run_lane_job(kind, 2, idle="a1", timeout=0.5, wait=5)
    assert "failed: TooSlowError: no share of ('grads', 0, 0, 0) within 0.5 s" in results[0]["error"]
    assert results[1] == {"sums": [], "reports": [], "finished": False}
