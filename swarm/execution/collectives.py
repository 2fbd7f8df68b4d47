"""Group operations over endpoints: all-gather of small values and ring all-reduce of
large tensors, deterministic so that every member ends with the same bits."""
from __future__ import annotations

import math

import torch
import trio

from swarm.execution import channels
from swarm.execution.endpoint import Endpoint


async def allgather(ep: Endpoint, group: list[str], key: tuple, arrays: list[torch.Tensor],
                    timeout: float = math.inf) -> list[list[torch.Tensor]]:
    """Every member's `arrays`, in group order, by Bruck's algorithm: in round r each member
    passes what it holds (its own and the next members' arrays, up to 2^r of them) to the
    member 2^r before it. ceil(log2 g) messages out and in per member instead of g-1: with
    small arrays (BatchNorm sums) the messages, not the bytes, are what costs."""
    n = len(group)
    me = group.index(ep.name)
    size = len(arrays)
    held = [arrays]  # held[j]: member (me + j) % n's arrays
    dist, r = 1, 0
    while dist < n:
        count = min(dist, n - dist)
        await ep.send(group[(me - dist) % n], channels.gather(key, r, me),
                      {"arrays": [a for block in held[:count] for a in block]})
        got = (await ep.mailbox.get(channels.gather(key, r, (me + dist) % n), timeout))["arrays"]
        if len(got) != count * size:
            raise ValueError(f"gather {key}: member {group[(me + dist) % n]} sent {len(got)} arrays, "
                             f"expected {count * size}")
        held += [got[i * size:(i + 1) * size] for i in range(count)]
        dist, r = dist * 2, r + 1
    return [held[(i - me) % n] for i in range(n)]


async def allreduce_sum(ep: Endpoint, group: list[str], key: tuple, flat: torch.Tensor,
                        timeout: float = math.inf) -> torch.Tensor:
    """Sum of `flat` (1-D) over the group, by a ring: reduce-scatter then all-gather. Each
    chunk is summed once, in ring order, and copied to everyone: identical results. The sum
    is made in `flat` itself (no copies), which is returned."""
    n = len(group)
    if n == 1:
        return flat
    me = group.index(ep.name)
    nxt = group[(me + 1) % n]
    total = flat  # summed in place, chunk by chunk (a send completes before its chunk changes)
    bounds = [round(i * total.numel() / n) for i in range(n + 1)]
    chunks = [total[bounds[i]:bounds[i + 1]] for i in range(n)]

    async def exchange(phase: str, k: int, send_idx: int, recv_idx: int, add: bool) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ep.send, nxt, channels.ring(key, phase, k, me), {"arrays": [chunks[send_idx]]})
            got = (await ep.mailbox.get(channels.ring(key, phase, k, (me - 1) % n), timeout))["arrays"][0]
        if add:
            chunks[recv_idx].add_(got)
        else:
            chunks[recv_idx].copy_(got)

    for k in range(n - 1):  # after this, member i holds the full sum of chunk (i + 1) % n
        await exchange("rs", k, (me - k) % n, (me - k - 1) % n, add=True)
    for k in range(n - 1):
        await exchange("ag", k, (me + 1 - k) % n, (me - k) % n, add=False)
    return total
