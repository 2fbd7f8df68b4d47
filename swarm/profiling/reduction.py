"""What a gradient sum costs a device per message beyond moving the message: measured once
with the profile, in process, at full speed.

A dp group sums its gradients in rounds (swarm.execution.collectives): each round a member
starts a task that sends its half while it waits for its partner's, checks the shape of what
came, slices and adds it in. The bandwidth job times bare messages between agents (what the
transport costs: framing, sealing, sockets), which is the planner's `msg_s`; the round's own
work comes on top of every message of a sum, and is the same whatever carries the message.
So it is measured here, apart from any wire: two endpoints of one in-memory network, the
all-reduce's own rounds on arrays of four floats against bare swaps of a one-element array,
each timed in CPU seconds of this thread, and the difference per message handled (sent or
received) is `reduce_msg_cpu_s`. Under a CPU quota of q cores it costs a device that over q
(`planner.cluster.Device.reduce_msg_s`, set by swarm.profiling.survey.cluster_from_live).

On this project's 2-core x86 machine a message of a sum at 2 took 37 us and a bare swap 19
(bench/RESULTS.md, 2026-11-29 15:12 UTC): the planner, charging only the swap, put the sums
of 16 and 32 in-process devices at 0.74 and 0.65 of the measure.
"""
from __future__ import annotations

import statistics
import time

SWAPS = 400  # bare swaps of a one-element array between two endpoints
SUMS = 100  # sums of four floats between two endpoints: two messages out and two in a member each
REPEATS = 3


def bare_message_cpu(swaps: int = SWAPS) -> float:
    """CPU seconds per message handled (sent or received) when two endpoints swap a
    one-element array, each sending from a task of its own while it waits for the other's and
    adding what comes, `swaps` times: what the transport's in-memory form costs a message."""
    import torch
    import trio

    from swarm.execution.endpoint import LocalNetwork

    network = LocalNetwork()
    eps = [network.endpoint("a"), network.endpoint("b")]
    sums = [torch.zeros(1), torch.zeros(1)]

    async def swap(me: int) -> None:
        for k in range(swaps):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(eps[me].send, eps[1 - me].name, ("swap", k, me), {"arrays": [sums[me]]})
                got = (await eps[me].mailbox.get(("swap", k, 1 - me)))["arrays"][0]
            sums[me].add_(got)

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(swap, 0)
            nursery.start_soon(swap, 1)

    cpu0 = time.thread_time()
    trio.run(both)
    return (time.thread_time() - cpu0) / (4 * swaps)  # two members, a message out and one in each


def sums_at_two_cpu(sizes: list[int]) -> float:
    """CPU seconds of summing a float32 array of each of `sizes` bytes between two endpoints by
    halving and doubling (the way groups of 8 to 64 sum), every sum under way at once."""
    import numpy as np
    import torch
    import trio

    from swarm.execution import collectives
    from swarm.execution.endpoint import LocalNetwork

    network = LocalNetwork()
    eps = [network.endpoint("a"), network.endpoint("b")]
    flats = [[torch.ones(max(1, n // 4)) for n in sizes] for _ in eps]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for b in range(len(sizes)):
                for i, ep in enumerate(eps):
                    nursery.start_soon(collectives._halving_doubling, ep, ["a", "b"], ("grads", 0, 0, b),
                                       flats[i][b], np.inf)

    cpu0 = time.thread_time()
    trio.run(main)
    return time.thread_time() - cpu0


def sum_message_cpu(sums: int = SUMS) -> float:
    """CPU seconds per message handled in a sum at 2: each member sends two and takes two."""
    return sums_at_two_cpu([16] * sums) / (2 * 2 * 2 * sums)


def reduce_msg_cpu(repeats: int = REPEATS) -> float:
    """The sum's own CPU per message handled beyond a bare message, at full speed: medians of
    `repeats` bursts of each, one of each left out first (it warms the interpreter's caches)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # four-float adds: what one core does, whatever the intra-op pool
    try:
        bare_message_cpu(SWAPS // 10), sum_message_cpu(SUMS // 10)
        bare = statistics.median(bare_message_cpu() for _ in range(repeats))
        summed = statistics.median(sum_message_cpu() for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return max(0.0, summed - bare)
