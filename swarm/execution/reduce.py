"""Summing a stage's gradients over its group (dp replicas, tiles on several devices), one
bucket of consecutive layers at a time, each as soon as it is final on this device: during
the step's last backward the upper layers' sums travel while the lower layers are still
being computed. The buckets are planner.buckets.buckets_of's, which the cost model
counts too.

Where the endpoint has gradient-sum lanes (a run over the network: swarm/execution/lane.py)
and the group sums straight (up to DIRECT_REDUCE_MAX members), the sums go on the lanes, one
bucket after another in the plan's order (Stage.sum_order: by default top layer first), and
their bytes never pass through the event loop; the result is the same bits. Summing straight,
each member owns a chunk of every bucket in proportion to the samples it computes a step
(Stage.sum_weights): a slow device that computes little sums little."""
from __future__ import annotations

import math

import torch
import trio

from planner.buckets import buckets_of, sum_sequence
from planner.stage_work import DIRECT_REDUCE_MAX
from swarm.execution.collectives import allreduce_sum
from swarm.local.compute_device import to_host


class GradReducer:
    def __init__(self, endpoint, group: list[str], key: tuple, net: torch.nn.Module, first: int, last: int,
                 nursery: trio.Nursery, timeout: float = math.inf, token=None, parts: int = 1, lanes=None,
                 stage: int = 0, sum_order: list[int] | None = None, weights: dict[str, int] | None = None):
        self.ep = endpoint
        self.group = group
        # the chunks each member owns, by the samples it computes (Stage.sum_weights; the same on every member)
        self.weights = [weights[d] for d in group] if weights and all(d in weights for d in group) else None
        self.key = key  # ("grads", step, stage)
        self.nursery = nursery
        self.timeout = timeout
        self.token = token or trio.lowlevel.current_trio_token()
        self.parts = parts  # local tiles that must each finish a layer before it is final here
        self.params = {i: [q for q in net.layers[i].parameters()] for i in range(first, last)}
        self.params = {i: params for i, params in self.params.items() if params}
        sizes = {i: sum(q.numel() * q.element_size() for q in params) for i, params in self.params.items()}
        self.buckets = {b[0]: b for b in buckets_of(sizes)}  # named by their top layer
        self.bucket_of = {layer: b[0] for b in self.buckets.values() for layer in b}
        self.counts: dict[int, int] = {}  # local parts done, by layer
        self.final: dict[int, set[int]] = {}  # final layers, by bucket
        self.started: dict[int, trio.Event] = {}
        self.seconds = 0.0
        self.error: BaseException | None = None  # raised by a callback from the compute thread
        self.lanes = lanes if lanes is not None and 1 < len(group) <= DIRECT_REDUCE_MAX else None
        self.stage = stage
        self.order = sum_sequence(list(self.buckets), sum_order)  # the lanes' order, the same on every member
        self.lane_done = {bucket: trio.Event() for bucket in self.buckets}

    # ---- from the compute thread ----------------------------------------------------------
    # A backward never waits for the event loop: what it reports is queued for the loop
    # (run_sync_soon, first in, first out, ahead of the thread's own return), so the layers
    # below go on computing while the loop is busy sending the upper layers' sums.
    def _soon(self, fn, layer: int) -> None:
        def call():
            try:
                fn(layer)
            except Exception as exc:  # (a callback the loop runs must not raise)
                self.error = self.error or exc
        self.token.run_sync_soon(call)

    def layer_done_from_thread(self, layer: int) -> None:
        """One local part finished `layer`'s gradients (a tile driver's callback)."""
        self._soon(self._count, layer)

    def hooks(self) -> list:
        """Post-accumulate hooks for an autograd backward: a layer is final once each of its
        parameters has its gradient. Returns the handles (remove them afterwards)."""
        handles = []
        seen: dict[int, set[int]] = {}
        for layer, params in self.params.items():
            for param in params:
                def hook(p, layer=layer, n=len(params)):
                    got = seen.setdefault(layer, set())
                    got.add(id(p))
                    if len(got) == n:
                        self._soon(self._layer_final, layer)
                handles.append(param.register_post_accumulate_grad_hook(hook))
        return handles

    # ---- in the event loop ----------------------------------------------------------------
    def _count(self, layer: int) -> None:
        self.counts[layer] = self.counts.get(layer, 0) + 1
        if self.counts[layer] == self.parts:
            self._layer_final(layer)

    def _layer_final(self, layer: int) -> None:
        bucket = self.bucket_of.get(layer)
        if bucket is None:
            return
        final = self.final.setdefault(bucket, set())
        final.add(layer)
        if len(final) == len(self.buckets[bucket]):
            self.start(bucket)

    def start(self, bucket: int) -> None:
        if bucket in self.buckets and bucket not in self.started:
            self.started[bucket] = trio.Event()
            self.nursery.start_soon(self._reduce, bucket)

    async def _reduce(self, bucket: int) -> None:
        params = self.bucket_params(bucket)
        t0 = trio.current_time()
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in params])
        if self.lanes is None:
            total = await allreduce_sum(self.ep, self.group, (*self.key, bucket), to_host(flat), self.timeout,
                                        self.weights)
        else:
            turn = self.order.index(bucket)
            if turn:
                await self.lane_done[self.order[turn - 1]].wait()
            total = await self.lanes.allreduce(self.stage, self.group, (*self.key, bucket), to_host(flat), self.timeout,
                                               self.weights)
            self.lane_done[bucket].set()
        offset = 0
        for q in params:  # the sum's own storage, a slice per parameter (the step sets grads to None)
            n = q.numel()
            q.grad = total[offset:offset + n].view_as(q).to(q.device)  # on an accelerator: one copy back
            offset += n
        self.seconds += trio.current_time() - t0
        self.started[bucket].set()

    def start_rest(self) -> None:
        """After the last backward: start what has not started (layers no hook reported)."""
        if self.error is not None:
            raise self.error
        for bucket in sorted(self.buckets, reverse=True):
            self.start(bucket)

    def bucket_params(self, bucket: int) -> list[torch.Tensor]:
        return [q for layer in self.buckets[bucket] for q in self.params[layer]]

    async def summed(self, bucket: int) -> None:
        """Wait until a started bucket's sum is in its parameters' gradients."""
        await self.started[bucket].wait()
