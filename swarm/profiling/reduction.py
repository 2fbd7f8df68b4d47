"""What a gradient sum costs a device per message beyond moving the message: measured once
with the profile, in process, at full speed.

A dp group sums its gradients in rounds (swarm.execution.collectives): each round a member
starts a task that sends its half while it waits for its partner's, checks the shape of what
came, slices and adds it in. The bandwidth job times bare messages between agents (what the
transport costs: framing, sealing, sockets), which is the planner's `msg_s`; the round's own
work comes on top of every message of a sum, and is the same whatever carries the message.
So it is measured here, apart from any wire: two endpoints of one in-memory network, the
all-reduce's own rounds on arrays of four floats against bare swaps of a one-element array,
as many under way at once as a model has gradient buckets, each timed in CPU seconds of this
thread inside a running loop, and the difference per message handled (sent or received) is
`reduce_msg_cpu_s`. Under a CPU quota of q cores it costs a device that over q
(`planner.cluster.Device.reduce_msg_s`, set by swarm.profiling.survey.cluster_from_live).
On this project's 2-core x86 machine: 17 us a bare message, and 5-6 more in a sum
(bench/RESULTS.md, 2026-11-29 16:25 UTC).
"""
from __future__ import annotations

import statistics
import threading
import time

LANES = 5  # sums under way at once on a device: a model's gradient buckets (yolov2-16 has 5)
ROUNDS = 60  # sums each lane runs, one after another
REPEATS = 7
# one measurement at a time in a process: threads measuring at once take the interpreter from
# each other, and a thread's CPU clock then counts the hand-overs (two agents in one process,
# as tests run them)
_MEASURING = threading.Lock()


def _timed(run_lanes) -> float:
    """CPU seconds of this thread inside one trio run of `run_lanes(lane)` for every lane at
    once, the run's own start and end left out (a device's loop is running already)."""
    import trio

    spent = []

    async def main() -> None:
        await trio.lowlevel.checkpoint()
        cpu0 = time.thread_time()
        async with trio.open_nursery() as nursery:
            for lane in range(LANES):
                nursery.start_soon(run_lanes, lane)
        spent.append(time.thread_time() - cpu0)

    trio.run(main)
    return spent[0]


def bare_message_cpu(rounds: int = ROUNDS) -> float:
    """CPU seconds per message handled (sent or received) when two endpoints of one in-memory
    network swap a one-element array the way a sum's round does (each sends from a task of its
    own while it waits for the other's) and add what comes, without the sum's own work: LANES
    lanes at once, each `rounds` times two swaps."""
    import torch
    import trio

    from swarm.execution.endpoint import LocalNetwork

    network = LocalNetwork()
    eps = [network.endpoint("a"), network.endpoint("b")]

    async def member(me: int, lane: int) -> None:
        into = torch.zeros(1)
        for k in range(2 * rounds):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(eps[me].send, eps[1 - me].name, ("swap", lane, k, me), {"arrays": [into]})
                got = (await eps[me].mailbox.get(("swap", lane, k, 1 - me)))["arrays"][0]
            into.add_(got)

    async def lane(k: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0, k)
            nursery.start_soon(member, 1, k)

    return _timed(lane) / (LANES * 2 * 2 * rounds * 2)  # two members, 2 swaps a round, a message out and in


def sum_message_cpu(rounds: int = ROUNDS, nbytes: int = 16) -> float:
    """CPU seconds per message handled in sums at 2 of a float32 array of `nbytes` by halving
    and doubling (the way groups of 8 to 64 sum; two messages out and two in a member): LANES
    lanes at once, each `rounds` sums one after another."""
    import numpy as np
    import torch
    import trio

    from swarm.execution import collectives
    from swarm.execution.endpoint import LocalNetwork

    network = LocalNetwork()
    eps = [network.endpoint("a"), network.endpoint("b")]

    async def lane(k: int) -> None:
        flats = [torch.ones(max(1, nbytes // 4)) for _ in eps]
        for r in range(rounds):
            async with trio.open_nursery() as nursery:
                for i, ep in enumerate(eps):
                    nursery.start_soon(collectives._halving_doubling, ep, ["a", "b"], ("grads", r, 0, k), flats[i],
                                       np.inf)

    return _timed(lane) / (LANES * 2 * 2 * 2 * rounds)


def reduce_msg_cpu(repeats: int = REPEATS) -> float:
    """The sum's own CPU per message handled beyond a bare message, at full speed: the median
    of `repeats` differences, each a sum's run right after a bare run, one of each left out
    first (it warms the interpreter's caches). Taken in pairs, whatever slows the machine for
    a while slows both sides of a difference: medians of each side taken apart, on a loaded
    host, read the sums as cheaper than bare messages (a profile in CI read 0)."""
    with _MEASURING:
        return _reduce_msg_cpu(repeats)


def _reduce_msg_cpu(repeats: int) -> float:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # four-float adds: what one core does, whatever the intra-op pool
    try:
        bare_message_cpu(ROUNDS // 10), sum_message_cpu(ROUNDS // 10)
        differences = []
        for _ in range(repeats):
            bare = bare_message_cpu()
            differences.append(sum_message_cpu() - bare)
    finally:
        torch.set_num_threads(threads)
    return max(0.0, statistics.median(differences))
