"""Group operations over endpoints: every member ends with the same, complete answer."""
import math

import pytest
import torch
import trio

from swarm.execution.collectives import allgather, allreduce_sum
from swarm.execution.endpoint import LocalNetwork


def _run_group(n: int, body):
    network = LocalNetwork()
    names = [f"d{i}" for i in range(n)]
    eps = [network.endpoint(name) for name in names]
    results = {}

    async def member(i):
        results[i] = await body(eps[i], names, i)

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(member, i)
    trio.run(main)
    return results, network


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9])
def test_allgather_gives_every_member_everyones_arrays_in_group_order(n):
    def mine(i):
        return [torch.full((2, 3), float(i)), torch.arange(i + 1, dtype=torch.float64)]

    async def body(ep, names, i):
        return await allgather(ep, names, ("bn", 0, 1), mine(i))

    results, network = _run_group(n, body)
    for i in range(n):
        got = results[i]
        assert len(got) == n
        for j in range(n):
            assert [t.tolist() for t in got[j]] == [t.tolist() for t in mine(j)]
    # each member's arrays travel to the n - 1 others once (Bruck's blocks): 6 * 4 + (i + 1) * 8 bytes
    assert network.bytes_sent == sum((n - 1) * (24 + (i + 1) * 8) for i in range(n))


def _gather_sends(n: int) -> tuple[list[str], list[tuple[str, str, tuple]]]:
    """An all-gather of one small array over n members: (their names, every (src, dst, key) sent)."""
    sent = []
    network = LocalNetwork()
    names = [f"d{i}" for i in range(n)]
    eps = [network.endpoint(name) for name in names]
    for ep in eps:
        original = ep.send

        async def counting(dst, key, payload, original=original, src=ep.name):
            sent.append((src, dst, key))
            await original(dst, key, payload)
        ep.send = counting

    async def main():
        async with trio.open_nursery() as nursery:
            for i, ep in enumerate(eps):
                nursery.start_soon(allgather, ep, names, ("k",), [torch.tensor([float(i)])])
    trio.run(main)
    return names, sent


def test_allgather_sends_log2_messages_per_member():  # g - 1 = 7 each before
    _, sent = _gather_sends(8)
    assert len(sent) == 8 * 3


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_allreduce_sum_is_the_sum_with_the_same_bits_everywhere(n):
    torch.manual_seed(n)
    values = [torch.randn(1001, dtype=torch.float32) for _ in range(n)]

    async def body(ep, names, i):
        return await allreduce_sum(ep, names, ("g", 0), values[i].clone())

    results, _ = _run_group(n, body)
    expected = torch.stack(values).sum(0)
    for i in range(n):
        assert torch.equal(results[i], results[0])
        assert torch.allclose(results[i], expected, atol=1e-5)


@pytest.mark.parametrize("size", [0, 3, 7, 8, 1001])
def test_allreduce_sum_of_arrays_smaller_than_the_group(size):
    values = [torch.arange(size, dtype=torch.float64) * (i + 1) for i in range(8)]

    async def body(ep, names, i):
        return await allreduce_sum(ep, names, ("g", 0), values[i].clone())

    results, _ = _run_group(8, body)
    for i in range(8):
        assert torch.equal(results[i], torch.arange(size, dtype=torch.float64) * 36)


@pytest.mark.parametrize("n, messages", [(8, 14), (4, 6), (2, 2), (6, 10), (16, 8), (12, 22)])
def test_allreduce_sum_messages_per_member(n, messages):
    """Up to 8 members sum straight to each chunk's owner and back (2(g - 1) messages each);
    larger groups of 2^k halve and double (2k, the same bytes); others ring."""
    sent = []
    network = LocalNetwork()
    names = [f"d{i}" for i in range(n)]
    eps = [network.endpoint(name) for name in names]
    for ep in eps:
        original = ep.send

        async def counting(dst, key, payload, original=original):
            sent.append(key)
            await original(dst, key, payload)
        ep.send = counting

    size = 840 * 4
    async def main():
        async with trio.open_nursery() as nursery:
            for i, ep in enumerate(eps):
                nursery.start_soon(allreduce_sum, ep, names, ("k",), torch.ones(size))
    trio.run(main)
    assert len(sent) == n * messages
    assert network.bytes_sent == n * 2 * (n - 1) * (size // n) * 4


def test_summing_straight_each_member_owns_a_chunk_by_its_weight_and_moves_what_that_makes_it():
    """With chunks by weight (a member computing 12 samples a step, two computing 2, one 4) every
    member still ends with the equal chunks' bits, and member j sends S - c_j of its own gradient
    plus its summed chunk to the g - 1 others: the light members send about their gradient alone."""
    from swarm.execution.collectives import chunk_bounds

    n, size, weights = 4, 2000, [12, 2, 2, 4]
    assert chunk_bounds(size, n, weights) == [0, 1200, 1400, 1600, 2000]
    assert chunk_bounds(size, n, [3, 3, 3, 3]) == chunk_bounds(size, n) == [0, 500, 1000, 1500, 2000]
    torch.manual_seed(0)
    values = [torch.randn(size, dtype=torch.float32) * 10 ** i for i in range(n)]
    names = [f"d{i}" for i in range(n)]

    def run(w):
        network = LocalNetwork()
        eps = [network.endpoint(name) for name in names]
        sent = dict.fromkeys(names, 0)
        for ep in eps:
            original = ep.send

            async def counting(dst, key, payload, original=original, name=ep.name):
                sent[name] += sum(a.numel() for a in payload["arrays"])
                await original(dst, key, payload)
            ep.send = counting
        flats = [v.clone() for v in values]

        async def main():
            async with trio.open_nursery() as nursery:
                for ep, flat in zip(eps, flats):
                    nursery.start_soon(allreduce_sum, ep, names, ("k",), flat, math.inf, w)
        trio.run(main)
        return flats, sent

    equal, equal_sent = run(None)
    weighed, weighed_sent = run(weights)
    assert all(torch.equal(a, b) for a, b in zip(weighed, equal))
    assert all(torch.equal(a, weighed[0]) for a in weighed)
    chunks = [1200, 200, 200, 400]
    assert [weighed_sent[d] for d in names] == [size - c + (n - 1) * c for c in chunks]
    assert all(v == 2 * (n - 1) * size // n for v in equal_sent.values())
    with pytest.raises(ValueError):
        chunk_bounds(size, n, [1, 2])


@pytest.mark.parametrize("way, n", [(way, n) for way in ("direct", "halving_doubling", "ring") for n in (2, 3, 5, 8)
                                     if way != "halving_doubling" or n & (n - 1) == 0])  # that one is for 2^k
def test_every_way_of_summing_gives_every_member_the_same_bits_each_time(way, n):
    """Each element is summed by one member in an order fixed by the group: the same bits
    everywhere, and run after run however the messages interleave (float32, so that the
    order shows), equal to the sum within rounding."""
    import random

    from swarm.execution import collectives
    fn = getattr(collectives, f"_{way}")
    torch.manual_seed(n)
    values = [torch.randn(997, dtype=torch.float32) * 10 ** (i % 4) for i in range(n)]

    def run(seed):
        rng = random.Random(seed)

        async def body(ep, names, i):
            original = ep.send

            async def shuffled(dst, key, payload):  # deliveries in a different order each run
                for _ in range(rng.randrange(4)):
                    await trio.lowlevel.checkpoint()
                await original(dst, key, payload)
            ep.send = shuffled
            return await fn(ep, names, ("g", 0), values[i].clone(), 10.0)
        return _run_group(n, body)[0]

    first = run(0)
    for i in range(n):
        assert torch.equal(first[i], first[0])
    assert torch.allclose(first[0], torch.stack(values).double().sum(0).float(), rtol=1e-5, atol=1e-3)
    for seed in (1, 2):
        again = run(seed)
        assert all(torch.equal(again[i], first[i]) for i in range(n))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allgather_of_a_small_group_takes_one_round_of_direct_messages(n):
    names, sent = _gather_sends(n)
    assert len(sent) == n * (n - 1)  # every member to every other, once
    assert {key[2] for _, _, key in sent} == {0}  # all in round 0
    assert {(src, dst) for src, dst, _ in sent} == {(a, b) for a in names for b in names if a != b}
