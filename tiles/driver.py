"""Drivers that step tile generators: all tiles of a stage in lockstep in one process.

    outs = run_lockstep([w.forward(mb, x_k) for w, x_k in zip(workers, inputs)])

Every tile yields the same sequence of requests; the driver gathers one request from each
tile, answers them all from memory (halo rectangles handed from sender to receiver,
channel sums added up in tile order), and resumes each tile with its answer, until all
return. It imports no torch: tensors are only sliced, passed and added.
"""
from __future__ import annotations

from collections.abc import Generator, Sequence

from tiles.regions import TilingError
from tiles.requests import ChannelSums, HaloExchange


def run_lockstep(gens: Sequence[Generator]) -> list:
    """Run tile generators (tile k = gens[k]) to completion; returns their return values."""
    results: list = [None] * len(gens)
    answers: list = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        requests = {}
        for k in live:
            try:
                requests[k] = gens[k].send(answers[k])
            except StopIteration as stop:
                results[k] = stop.value
        if not requests:
            break
        if len(requests) != len(live):
            done = sorted(set(live) - set(requests))
            raise TilingError(f"tiles {done} finished while others still wait for a collective")
        keys = {req.key for req in requests.values()}
        if len(keys) != 1:
            raise TilingError(f"tiles are out of step: {sorted(map(str, keys))}")
        answers = [None] * len(gens)
        for k, a in answer_all(requests).items():
            answers[k] = a
        live = sorted(requests)
    return results


def answer_all(requests: dict) -> dict:
    """Answers to one round of identical-key requests from every tile, by tile."""
    first = next(iter(requests.values()))
    if isinstance(first, ChannelSums):
        total = None
        for k in sorted(requests):
            v = requests[k].values
            total = v.clone() if total is None else total + v
        return {k: total for k in requests}
    if isinstance(first, HaloExchange):
        mailbox = {}
        for k, req in requests.items():
            for dst, rect, tensor in req.sends:
                mailbox[(k, dst, rect)] = tensor
        out = {}
        for k, req in requests.items():
            try:
                out[k] = [mailbox.pop((src, k, rect)) for src, rect in req.receives]
            except KeyError as missing:
                raise TilingError(f"tile {k} waits for {missing} that no tile sends") from None
        if mailbox:
            raise TilingError(f"halo parts sent but never received: {sorted(mailbox)[:3]}")
        return out
    raise TilingError(f"unknown request {type(first).__name__}")
