"""Summing a stage's gradients over its group (dp replicas, tiles on several devices), one
layer at a time, each as soon as it is final on this device: during the step's last
backward the upper layers' sums travel while the lower layers are still being computed."""
from __future__ import annotations

import math

import torch
import trio

from swarm.execution.collectives import allreduce_sum


class GradReducer:
    def __init__(self, endpoint, group: list[str], key: tuple, net: torch.nn.Module, first: int, last: int,
                 nursery: trio.Nursery, timeout: float = math.inf, token=None, parts: int = 1):
        self.ep = endpoint
        self.group = group
        self.key = key  # ("grads", step, stage)
        self.nursery = nursery
        self.timeout = timeout
        self.token = token
        self.parts = parts  # local tiles that must each finish a layer before it is final here
        self.buckets = {i: [q for q in net.layers[i].parameters()] for i in range(first, last)}
        self.buckets = {i: params for i, params in self.buckets.items() if params}
        self.counts: dict[int, int] = {}
        self.started: dict[int, trio.Event] = {}
        self.seconds = 0.0

    # ---- from the compute thread ----------------------------------------------------------
    def layer_done_from_thread(self, layer: int) -> None:
        """One local part finished `layer`'s gradients (a tile driver's callback)."""
        trio.from_thread.run_sync(self._count, layer, trio_token=self.token)

    def hooks(self) -> list:
        """Post-accumulate hooks for an autograd backward: a layer is final once each of its
        parameters has its gradient. Returns the handles (remove them afterwards)."""
        handles = []
        seen: dict[int, set[int]] = {}
        for layer, params in self.buckets.items():
            for param in params:
                def hook(p, layer=layer, n=len(params)):
                    got = seen.setdefault(layer, set())
                    got.add(id(p))
                    if len(got) == n:
                        trio.from_thread.run_sync(self.start, layer, trio_token=self.token)
                handles.append(param.register_post_accumulate_grad_hook(hook))
        return handles

    # ---- in the event loop ----------------------------------------------------------------
    def _count(self, layer: int) -> None:
        self.counts[layer] = self.counts.get(layer, 0) + 1
        if self.counts[layer] == self.parts:
            self.start(layer)

    def start(self, layer: int) -> None:
        if layer in self.buckets and layer not in self.started:
            self.started[layer] = trio.Event()
            self.nursery.start_soon(self._reduce, layer)

    async def _reduce(self, layer: int) -> None:
        params = self.buckets[layer]
        t0 = trio.current_time()
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in params])
        total = await allreduce_sum(self.ep, self.group, (*self.key, layer), flat, self.timeout)
        offset = 0
        for q in params:  # the sum's own storage, a slice per parameter (the step sets grads to None)
            n = q.numel()
            q.grad = total[offset:offset + n].view_as(q)
            offset += n
        self.seconds += trio.current_time() - t0
        self.started[layer].set()

    async def finish(self) -> None:
        """Start what has not started (layers no hook reported), then wait for every sum."""
        for layer in sorted(self.buckets, reverse=True):
            self.start(layer)
        for event in self.started.values():
            await event.wait()
