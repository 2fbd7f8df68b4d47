"""Timing a model's layers: forward and backward inside training passes, updates, fitted to steps.

Each layer's forward and backward inside whole training passes over a range of layers
(`time_in_context`), whole passes over a range (`time_pass`), each layer's optimizer update
(`time_updates`), the tiles executor's overhead over autograd (`time_tiles_overhead`), and
fitting the layers' times to whole steps (`fit_to_steps`): the layer timings give the
split, the whole steps the total."""
from __future__ import annotations

import itertools
import statistics

from swarm.host import malloc
from swarm.profiling.clocks import Budget, Stopwatch, median_time, within_budget

FIT_LIMITS = (0.5, 2.0)  # a fit beyond these says the measurements disagree: keep the layers' own sum


def layer_inputs(net, desc, images: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every layer's output (and the image as -1) for one batch, without autograd."""
    import torch

    with torch.no_grad():
        outs = {-1: images}  # uint8: the first layer's time includes turning it into floats, as in training
        for i in range(len(desc.layers)):
            outs.update(net.forward_range(i, i + 1, {s: outs[s] for s in desc.live_after(i)},
                                          keys=list(range(len(images)))))
    return outs


def time_in_context(net, desc, loss_fn, live, targets, budget: Budget, watch: Stopwatch,
                    first: int = 0, last: int | None = None):
    """Per-layer forward and backward seconds of layers [first, last) (default: all),
    measured inside whole training passes over them (so each layer meets its data as a real
    step does: produced by the layer before, not cached from a previous run of itself), and
    the loss head's when the range ends the model. `live`: what the range reads from before
    `first` (the images, -1, for the whole model); maps given to a later piece take a
    gradient, as a stage's input does. A range that stops short of the loss runs its
    backward from a fixed random gradient of what leaves it. Forward: the clock between layer
    calls. Backward: gradient hooks on every layer's output stamp the moment its gradient is
    complete; a layer's backward is the time from its output's stamp to its input's.
    Returns (forward per layer, backward per layer, loss forward, loss backward), medians
    (the loss's 0.0 for a range that does not end the model)."""
    import torch

    L = len(desc.layers)
    last = L if last is None else last
    n = last - first
    keys = list(range(len(next(iter(live.values())))))
    leaving = _leaving(desc, first, last)
    gen = torch.Generator().manual_seed(0)
    runs, grads = [], None
    for _ in itertools.chain(["warm-up"], within_budget(budget)):  # the first run warms up
        outs = {s: t if s < 0 else t.detach().requires_grad_(True) for s, t in live.items()}
        t = [watch.mark()]
        for i in range(first, last):
            outs.update(net.forward_range(i, i + 1, {s: outs[s] for s in desc.live_after(i)}, keys))
            t.append(watch.mark())
        ends, grads = _ends(desc, outs, loss_fn, targets, leaving, last == L, grads, gen)
        t_loss = watch.mark()
        stamps = {}
        for i in range(first, last):
            outs[i].register_hook(lambda g, i=i: stamps.__setitem__(i, watch.mark()))
        t0 = watch.mark()
        torch.autograd.backward(ends, grads)
        t_end = watch.mark()
        watch.settle()
        net.zero_grad(set_to_none=True)
        fwd = [watch.seconds(t[k], t[k + 1]) for k in range(n)]
        ready = [stamps.get(i, t0) for i in range(first, last)]  # dL/d(output of i) complete
        bwd = [max(0.0, watch.seconds(ready[k], ready[k - 1] if k > 0 else t_end)) for k in range(n)]
        loss = (watch.seconds(t[n], t_loss), watch.seconds(t0, ready[n - 1])) if last == L else (0.0, 0.0)
        runs.append((fwd, bwd) + loss)
        del outs, ends
    runs = runs[1:]
    fwd = [statistics.median(r[0][k] for r in runs) for k in range(n)]
    bwd = [statistics.median(r[1][k] for r in runs) for k in range(n)]
    return fwd, bwd, statistics.median(r[2] for r in runs), statistics.median(r[3] for r in runs)


def _leaving(desc, first: int, last: int) -> list[int]:
    """The maps layers [first, last) make that are read after them (the model's output at its end)."""
    return [s for s in desc.live_after(last) if s >= first]


def _ends(desc, outs, loss_fn, targets, leaving, at_loss: bool, grads, gen):
    """(what a backward over a pass starts from, their gradients): the loss at the model's end,
    else the maps that leave the range with fixed random gradients (made on the first call)."""
    import torch

    if at_loss:
        return [loss_fn(desc.head_of(outs), targets, len(targets))], None
    ends = [outs[s] for s in leaving]
    return ends, grads or [torch.randn(e.shape, generator=gen).to(e) for e in ends]


def time_pass(net, desc, loss_fn, live, targets, first: int, last: int, budget: Budget, watch: Stopwatch) -> float:
    """A whole training pass over layers [first, last) (forward, backward, no clock in between),
    timed as a whole step is: what the range's per-layer times are fitted to."""
    import torch

    L = len(desc.layers)
    keys = list(range(len(next(iter(live.values())))))
    leaving, gen, grads = _leaving(desc, first, last), torch.Generator().manual_seed(0), None

    def one_pass():
        nonlocal grads
        outs = {s: t if s < 0 else t.detach().requires_grad_(True) for s, t in live.items()}
        outs.update(net.forward_range(first, last, outs, keys))
        ends, grads = _ends(desc, outs, loss_fn, targets, leaving, last == L, grads, gen)
        torch.autograd.backward(ends, grads)
        net.zero_grad(set_to_none=True)

    one_pass()  # warm up
    return median_time(one_pass, budget, watch)


def time_updates(net, desc, budget: Budget, optimizer: str, watch: Stopwatch) -> list[float]:
    """The optimizer step over each layer's parameters, one layer at a time (its gradients and
    state exist only while it is timed, and go back to the system after it: layer sizes grow
    toward the head, so the freed blocks of one would not hold the next, and a process that
    keeps them, as a tuned agent does, would hold every layer's at once)."""
    import torch

    from swarm.local.trainer import TrainConfig, make_optimizer, optimizer_step

    out = []
    for i in range(len(desc.layers)):
        named = [(n, p) for n, p in net.layers[i].named_parameters()]
        if not named:
            out.append(0.0)
            continue
        opt = make_optimizer(named, TrainConfig(optimizer=optimizer))
        for _, p in named:
            p.grad = torch.empty_like(p).normal_(std=1e-6)
        with torch.no_grad():
            before = [p.detach().clone() for _, p in named]
            optimizer_step(opt)  # creates the momentum buffers
            out.append(median_time(lambda: optimizer_step(opt), budget, watch))
            for (_, p), b in zip(named, before):
                p.copy_(b)
        for _, p in named:
            p.grad = None
        del opt, before
        malloc.give_back()
    return out


def time_tiles_overhead(net, desc, batch: int, budget: Budget, watch: Stopwatch) -> float:
    """The tiles executor's time over autograd's for the same forward and backward of the
    model's tileable front on `batch` samples, both on this thread, as one 1x1 tile (its own
    kernels and bookkeeping; no halos, which the tiles cost model counts itself). 1.0 when
    the model has no tileable front."""
    import torch

    from tiles.grouping import Grouping
    from tiles.layout import tileable_prefix
    from tiles.whole_stage import InProcessStage

    n = tileable_prefix(desc)
    if n == 0:
        return 1.0
    layers = list(net.layers[:n])
    stage = InProcessStage.build(layers, desc.layers[:n], (1, 1), Grouping.every_layer(0, n), False)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, *desc.layers[0].in_shape, generator=gen).to(watch.device)
    dy = torch.randn(batch, *desc.layers[n - 1].out_shape, generator=gen).to(watch.device)

    def untiled():  # the front as the network runs it: a graph's layers read the maps they name
        y = net.forward_range(0, n, {-1: x})[n - 1]
        (y * dy).sum().backward()
        net.zero_grad(set_to_none=True)

    def tiled():
        stage.forward(0, x, (batch,))
        stage.backward(0, dy)
        net.zero_grad(set_to_none=True)

    untiled(), tiled()  # warm up
    # the median ratio of OVERHEAD_RUNS pairs at least (within the timing budget), each pair one
    # pass of each back to back: a run caught behind another process does not decide it, and
    # a host that slows for a while slows both sides of the pairs it meets
    budget = budget._replace(repeats=max(budget.repeats, OVERHEAD_RUNS))
    once = Budget(1, budget.stop)
    ratios = []
    for _ in within_budget(budget):
        base = median_time(untiled, once, watch)
        ratios.append(median_time(tiled, once, watch) / base if base > 0 else 1.0)
    return statistics.median(ratios)


OVERHEAD_RUNS = 5


def fit_to_steps(fwd, bwd, loss_f, loss_b, update: float, steps: list[float]) -> list[float]:
    """Scale each batch size's layer and loss times (in place) so that with the updates they add
    up to the whole step measured at that size. Timing layer by layer adds the clock's own
    reads and hooks, and under a quota each short timing rounds up to the throttling it meets;
    a whole step is one long measurement of the same work. The layer timings give the split,
    the steps the total. Returns the factor per batch size."""
    factors = []
    for k, step in enumerate(steps):
        layers = sum(fwd[k]) + sum(bwd[k]) + loss_f[k] + loss_b[k]
        factor = (step - update) / layers if layers > 0 and step > update else 1.0
        if not FIT_LIMITS[0] <= factor <= FIT_LIMITS[1]:
            factor = 1.0
        fwd[k] = [t * factor for t in fwd[k]]
        bwd[k] = [t * factor for t in bwd[k]]
        loss_f[k] *= factor
        loss_b[k] *= factor
        factors.append(factor)
    return factors
