"""Gradient reduction during the backward: the backward never waits for the event loop (which
may be busy sending the upper layers' sums), and every member ends with the group's sum."""
from __future__ import annotations

import threading

import torch
import trio
from torch import nn

from swarm.execution.endpoint import LocalNetwork
from swarm.execution.reduce import GradReducer


class Layers(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(6, 5), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.parameters()]


def test_the_backward_runs_on_while_the_event_loop_is_busy_and_members_get_the_sum():
    network = LocalNetwork()
    names = ["d0", "d1"]
    nets = [Layers(0), Layers(0)]
    inputs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    alone = []
    for net, x in zip([Layers(0), Layers(0)], inputs):
        net(x).square().sum().backward()
        alone.append(_grads(net))
    finished = []

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                reducers = [GradReducer(network.endpoint(name), names, ("grads", 0, 0), net, 0, len(net.layers),
                                        nursery) for name, net in zip(names, nets)]
                handles = [h for r in reducers for h in r.hooks()]
                done = [threading.Event() for _ in names]

                def backward(i):
                    nets[i](inputs[i]).square().sum().backward()
                    done[i].set()
                threads = [threading.Thread(target=backward, args=(i,), daemon=True) for i in range(2)]
                for t in threads:
                    t.start()
                # The loop is held (as by a long send) until both backwards are done: a hook
                # that waited for it would never return.
                finished.extend(d.wait(timeout=10) for d in done)
                for h in handles:
                    h.remove()
                if all(finished):  # as the worker ends a step: start what is left, wait for every sum
                    async with trio.open_nursery() as waits:
                        for r in reducers:
                            r.start_rest()
                            for bucket in r.buckets:
                                waits.start_soon(r.summed, bucket)

    trio.run(main)
    assert finished == [True, True]
    want = [a + b for a, b in zip(*alone)]
    for net in nets:
        for got, expected in zip(_grads(net), want):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
