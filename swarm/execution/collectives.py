"""Group operations over endpoints: all-gather of small values and all-reduce of large
tensors (straight to each chunk's owner and back, halving and doubling, or a ring),
deterministic so that every member ends with the same bits."""
from __future__ import annotations

import math

import torch
import trio

from planner.stage_work import DIRECT_GATHER_MAX, DIRECT_REDUCE_MAX
from swarm.execution import channels
from swarm.execution.endpoint import Endpoint


async def allgather(ep: Endpoint, group: list[str], key: tuple, arrays: list[torch.Tensor],
                    timeout: float = math.inf) -> list[list[torch.Tensor]]:
    """Every member's `arrays`, in group order.

    A group of up to DIRECT_GATHER_MAX members gathers in one round: each member sends its
    arrays to every other and waits for theirs. Larger ones use Bruck's algorithm: in round r
    each member passes what it holds (its own and the next members' arrays, up to 2^r of
    them) to the member 2^r before it, ceil(log2 g) messages out and in per member instead of
    g-1. With small arrays (BatchNorm sums) what costs is the messages and, where devices
    wait for each other at every BatchNorm layer, the rounds: a round is a hop on which any
    member may be late (on a CPU quota, one that has spent its share waits for the next
    period), and Bruck's second round forwards what came in the first."""
    if len(group) <= DIRECT_GATHER_MAX:
        return await _direct_gather(ep, group, key, arrays, timeout)
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


async def _direct_gather(ep: Endpoint, group: list[str], key: tuple, arrays: list[torch.Tensor],
                         timeout: float) -> list[list[torch.Tensor]]:
    me = group.index(ep.name)
    for j, member in enumerate(group):
        if j != me:
            await ep.send(member, channels.gather(key, 0, me), {"arrays": arrays})
    out = []
    for j, member in enumerate(group):
        if j == me:
            out.append(arrays)
            continue
        got = (await ep.mailbox.get(channels.gather(key, 0, j), timeout))["arrays"]
        if len(got) != len(arrays):
            raise ValueError(f"gather {key}: member {member} sent {len(got)} arrays, expected {len(arrays)}")
        out.append(got)
    return out


async def allreduce_sum(ep: Endpoint, group: list[str], key: tuple, flat: torch.Tensor,
                        timeout: float = math.inf, weights: list[int] | None = None) -> torch.Tensor:
    """Sum of `flat` (1-D) over the group. Each element is summed by one member, in an order
    fixed by the group alone, and copied to the others: every member ends with the same
    bits. The sum is made in `flat` itself, which is returned. Every way below moves the
    same bytes, 2(g - 1)/g of `flat` out and in per member.

    A group of up to DIRECT_REDUCE_MAX members sums straight (_direct): each member sends
    chunk j to member j, which sums it and sends the sum to every other, two rounds of
    g - 1 messages out and in at once. Larger groups of 2^k members halve and double
    (Rabenseifner): k rounds of reduce-scatter, in round r each member swapping half of what
    it still sums with the member whose index differs from its own in bit r, then k rounds
    of all-gather back, 2k messages where a ring takes 2(g - 1). Other sizes go round a
    ring. Fewer messages cost less CPU, but every round waits for one partner's previous
    round, and on devices with a CPU quota some partner is often late: on 8 devices of 0.2
    core at 100 Mbit, dp trained 8% faster summing straight than halving and doubling
    (bench/RESULTS.md, "Sums straight to each chunk's owner").

    Summing straight, member j owns a chunk in proportion to weights[j] (chunk_bounds; equal
    chunks without weights): a member that computes less sums less, and every member still
    ends with the same bits, since each element is summed in group order whoever sums it.
    Every member must pass the same weights."""
    n = len(group)
    if n == 1:
        return flat
    if n <= DIRECT_REDUCE_MAX:
        return await _direct(ep, group, key, flat, timeout, weights)
    if n & (n - 1) == 0:
        return await _halving_doubling(ep, group, key, flat, timeout)
    return await _ring(ep, group, key, flat, timeout)


async def _swap(ep: Endpoint, dst: str, send_key: tuple, recv_key: tuple, array: torch.Tensor, into: torch.Tensor,
                timeout: float) -> torch.Tensor:
    """Send `array` to `dst` while waiting for the message `recv_key`; its array, which must
    have the shape of `into` (where it goes)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ep.send, dst, send_key, {"arrays": [array]})
        got = (await ep.mailbox.get(recv_key, timeout))["arrays"]
    if len(got) != 1 or got[0].shape != into.shape:
        raise ValueError(f"{recv_key}: expected one array of {tuple(into.shape)}, got "
                         f"{[tuple(a.shape) for a in got]}")
    return got[0]


async def _halving_doubling(ep: Endpoint, group: list[str], key: tuple, flat: torch.Tensor,
                            timeout: float) -> torch.Tensor:
    n = len(group)
    me = group.index(ep.name)
    lo, hi = 0, flat.numel()
    rounds = []  # (partner, the part we gave away) in reduce-scatter order
    dist, r = 1, 0
    while dist < n:  # partners share [lo, hi): they differ only in bit `dist`
        partner = me ^ dist
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if me & dist else ((lo, mid), (mid, hi))
        kept = flat[keep[0]:keep[1]]
        got = await _swap(ep, group[partner], channels.ring(key, "hs", r, me), channels.ring(key, "hs", r, partner),
                          flat[give[0]:give[1]], kept, timeout)
        kept.add_(got)
        rounds.append((partner, give))
        lo, hi = keep
        dist, r = dist * 2, r + 1
    for r in reversed(range(len(rounds))):  # we hold the whole sum of [lo, hi); pass it back up
        partner, (glo, ghi) = rounds[r]
        gave = flat[glo:ghi]
        got = await _swap(ep, group[partner], channels.ring(key, "hd", r, me), channels.ring(key, "hd", r, partner),
                          flat[lo:hi], gave, timeout)
        gave.copy_(got)
        lo, hi = min(lo, glo), max(hi, ghi)
    return flat


def chunk_bounds(numel: int, n: int, weights: list[int] | None = None) -> list[int]:
    """Where each of n members' chunks of a sum of `numel` elements begins (and, last, where the
    last ends): equal chunks, or chunks in proportion to `weights`.

    A member's part of a sum straight to each chunk's owner is its own chunk c_j, summed from
    every member's and sent back to each, and what it sends and receives of the other chunks:
    2(S - c_j) + 2(g - 1)c_j elements moved of a sum of S over g members. With equal chunks every
    member moves 4(g - 1)/g S; with chunks by the samples each computes, a device that computes
    little moves little more than its gradient out and the sums in (2S)."""
    if not weights or len(set(weights)) == 1:
        return [round(i * numel / n) for i in range(n + 1)]
    if len(weights) != n or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"chunk weights {weights} for {n} members")
    total, ends, run = sum(weights), [0], 0
    for w in weights:
        run += w
        ends.append(round(run * numel / total))
    return ends


async def _direct(ep: Endpoint, group: list[str], key: tuple, flat: torch.Tensor, timeout: float,
                  weights: list[int] | None = None) -> torch.Tensor:
    """Reduce-scatter straight to each chunk's owner, then all-gather straight from it: each
    member sends chunk j to member j, sums its own chunk from every member's in group order,
    and sends the sum to every other. A member waits for no partner's earlier round."""
    n = len(group)
    me = group.index(ep.name)
    bounds = chunk_bounds(flat.numel(), n, weights)
    chunks = [flat[bounds[i]:bounds[i + 1]] for i in range(n)]
    mine = chunks[me]

    async def send_all(phase: str, pick) -> None:
        async with trio.open_nursery() as nursery:
            for j in range(n):
                if j != me:
                    nursery.start_soon(ep.send, group[j], channels.ring(key, phase, j, me), {"arrays": [pick(j)]})

    async def take(phase: str, k: int, src: int, into: torch.Tensor) -> torch.Tensor:
        got = (await ep.mailbox.get(channels.ring(key, phase, k, src), timeout))["arrays"]
        if len(got) != 1 or got[0].shape != into.shape:
            raise ValueError(f"{key}: member {group[src]} sent {[tuple(a.shape) for a in got]}, "
                             f"expected one array of {tuple(into.shape)}")
        return got[0]

    own = mine.clone()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all, "ds", lambda j: chunks[j])
        total = None  # member 0's share, then 1's added, and so on: an order fixed by the group
        for src in range(n):
            part = own if src == me else await take("ds", me, src, mine)
            if total is None:
                total = part if src == me else part.clone()  # (our own is a copy already)
            else:
                total.add_(part)
    mine.copy_(total)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all, "dg", lambda j: mine)
        for src in range(n):
            if src != me:
                chunks[src].copy_(await take("dg", me, src, chunks[src]))
    return flat


async def _ring(ep: Endpoint, group: list[str], key: tuple, flat: torch.Tensor, timeout: float) -> torch.Tensor:
    """Ring reduce-scatter then all-gather. Each chunk is summed once, in ring order, and
    copied to everyone."""
    n = len(group)
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
