"""Measuring a model too big to step whole on this device, in pieces of layers that fit.

The full yolov2 on a 1 GiB Pi: its layers in contiguous pieces that each fit
(`MemoryGuard.pieces`), every layer timed inside passes over its piece, each piece's times
fitted to whole passes over it."""
from __future__ import annotations

import numpy as np

from swarm.errors import SwarmError
from swarm.profiling.clocks import Budget, Stopwatch
from swarm.profiling.layer_times import fit_to_steps, time_in_context, time_pass
from swarm.profiling.memory_guard import MemoryGuard, PeakRSS, settled_rss
from swarm.profiling.saved_bytes import saved_bytes


def measure_in_pieces(net, desc, loss_fn, data, batch_sizes, fits: MemoryGuard, budget: Budget,
                      watch: Stopwatch, pass_watch: Stopwatch, say):
    """A model too big to step whole on this device (its gradients and optimizer state beside
    the model and a sample's activations; the full yolov2 on a 1 GiB Pi), measured in
    contiguous pieces of layers that each fit (MemoryGuard.pieces): every layer's forward and
    backward inside a pass over its piece, the piece's input given by the pieces before it
    (without autograd), and what each layer saves for its backward. Each piece's layer times
    are fitted to whole passes over it, as a whole model's are to whole steps; there is no
    whole step's peak. Returns (batch sizes measured, forward and backward per layer at each
    size with the loss head's last, saved bytes per sample per layer, the idle process's
    resident bytes, the first size's pieces)."""
    import torch

    from swarm.data import class_targets, make_batch

    L = len(desc.layers)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    measured, fwd, bwd, saved, runtime, first_cuts = [], [], [], [0.0] * L, None, None
    for b in batch_sizes:
        fits.base = settled_rss()  # what the last size's passes left behind counts
        cuts = fits.pieces(b)
        if cuts is None:
            if not measured:
                raise SwarmError(fits.too_small(b, fits.first_too_big(b)))
            say(f"batch {b}: skipped, layer {fits.first_too_big(b)} alone would not fit")
            break
        measured.append(b)
        first_cuts = first_cuts or cuts
        say(f"batch {b}: layers in {len(cuts)} pieces ({', '.join(f'{a}-{e - 1}' for a, e in cuts)}), the model "
            "being too big to step whole here")
        images, targets = make_batch(data, np.arange(b) % len(data))
        tgt = torch.from_numpy(targets if desc.detects else class_targets(targets))
        f, bk, live = [0.0] * (L + 1), [0.0] * (L + 1), {-1: torch.from_numpy(images)}
        for first, last in cuts:
            with PeakRSS() as rss:
                pf, pb, lf, lb = time_in_context(net, desc, loss_fn, live, tgt, budget, watch, first, last)
            fits.base = settled_rss()
            fits.measured_piece(b, first, last, float(rss.peak))
            lf, lb = [lf], [lb]
            fit_to_steps([pf], [pb], lf, lb, 0.0, [time_pass(net, desc, loss_fn, live, tgt, first, last, budget,
                                                              pass_watch)])
            f[first:last], bk[first:last] = pf, pb
            if last == L:
                f[L], bk[L] = lf[0], lb[0]
            if runtime is None:  # the idle process: torch initialised by a pass, less the model's weights
                runtime = fits.base - weights
            with torch.no_grad():
                outs = dict(live)
                for i in range(first, last):
                    outs.update(net.forward_range(i, i + 1, {s: outs[s] for s in desc.live_after(i)}, list(range(b))))
            saved[first:last] = saved_bytes(net, desc, outs, b, range(first, last))
            live = {s: outs[s] for s in desc.live_after(last)} if last < L else {}
            del outs
        fwd.append(f)
        bwd.append(bk)
    return measured, fwd, bwd, saved, float(runtime), first_cuts
