"""Measuring this device running a model, into a planner DeviceProfile (`profile_model`).

Per-layer forward, backward and update time at several batch sizes, the bytes autograd
keeps per layer, and the time and peak memory of whole local steps, on the accelerator the
device computes on (its CPU, or CUDA: then also the rate of the copies between host and
accelerator, and the accelerator's memory). A model too big to step whole on this device
is measured in pieces of consecutive layers that fit (swarm/profiling/pieces.py)."""
from __future__ import annotations

import threading
from datetime import datetime, timezone

import numpy as np

from planner.costs import CostTable
from planner.image_size import ImageSize
from planner.profile import DeviceProfile
from swarm.data import default_classes  # noqa: F401 (profile_model's; swarm.profiling.profiler's too)
from swarm.errors import SwarmError
from swarm.host.resources import compute_threads, cpu_quota
from swarm.profiling.accelerator import AcceleratorMemory, accelerator_identity, copy_gbps
from swarm.profiling.cache import device_facts
from swarm.profiling.clocks import CLOCKS, Budget, QuotaClock, QuotaCPUClock, Stopwatch, median_time
from swarm.profiling.layer_times import (fit_to_steps, layer_inputs, time_in_context, time_tiles_overhead,
                                         time_updates)
from swarm.profiling.memory_guard import OPTIMIZER_COPIES, MemoryGuard, PeakRSS, settled_rss
from swarm.profiling.pieces import measure_in_pieces
from swarm.profiling.saved_bytes import saved_bytes

DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_REPEATS = 5


def profile_model(model: str = "yolov2-16", img_size: ImageSize | int | None = None, classes: int | None = None,
                  batch_sizes=DEFAULT_BATCH_SIZES, repeats: int = DEFAULT_REPEATS, threads: int | None = None,
                  cfg_text: str | None = None, optimizer: str = "sgd", log=None, clock: str = "wall",
                  device=None, stop: threading.Event | None = None, memory_limit: int | None = None) -> DeviceProfile:
    """Measure this device running `model` on `device` (a torch.device; None: the host CPU),
    with the built-in synthetic data for inputs. clock "cpu" counts this thread's CPU time
    instead of the wall clock (one thread only, on the CPU); on CUDA, CUDA events time the
    work. A model too big to step whole in the host's memory is measured in pieces
    (measure_in_pieces). `memory_limit`: the bytes the profile may count on (MemoryGuard's
    limit; None: what this device can spare now, with the default reserve).

    A model with a BatchNorm over a 1x1 map cannot train on one sample (one value per
    channel; swarm.local.batchnorm_check): it is measured at 2 samples wherever it would have
    been at 1 (batch sizes 1,2,4,8 are measured as 2,4,8; 1 alone as 2), and its figures per
    sample come from those: the bytes autograd keeps and the memory guard's peaks are divided
    by the samples measured, as at any size, and the cost table, which then starts at 2, gives
    one sample half the time of two (CostTable's proportional rule below its smallest size).
    Other models are measured at the sizes asked for."""
    import torch

    from swarm.data import make_batch, open_datasets
    from swarm.local.batchnorm_check import fewest_samples, single_value_batchnorms
    from swarm.local.compute_device import HOST
    from swarm.zoo import build_model, describe_model
    from swarm.zoo.loss import make_loss

    batch_sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
    if not batch_sizes or batch_sizes[0] < 1:
        raise SwarmError(f"batch sizes to profile must be positive, got {batch_sizes}")
    if repeats < 1:
        raise SwarmError(f"--repeats must be at least 1, got {repeats}")
    budget = Budget(repeats, stop)
    threads = threads or compute_threads()
    if clock not in CLOCKS:
        raise SwarmError(f"unknown clock '{clock}'; use {' or '.join(CLOCKS)}")
    if clock == "cpu" and threads != 1:
        raise SwarmError("the cpu clock measures one compute thread: use --threads 1")
    device = device or HOST
    if clock == "cpu" and device != HOST:
        raise SwarmError(f"the cpu clock times the CPU; a profile on {device.type} is timed by the accelerator")
    now = layer_clock = CLOCKS[clock]
    quota = cpu_quota()
    if clock == "wall" and quota is not None and quota < threads:
        now, layer_clock = QuotaClock(quota), QuotaCPUClock(quota)
    step_watch, layer_watch = Stopwatch(device, now), Stopwatch(device, layer_clock)
    accelerator = accelerator_identity(device)
    torch.set_num_threads(threads)
    desc0 = describe_model(model, img_size, None, cfg_text)
    say = log or (lambda _msg: None)
    least = fewest_samples(desc0)
    if batch_sizes[0] < least:  # measured at `least` samples instead, per-sample figures derived from those
        batch_sizes = tuple(sorted({max(b, least) for b in batch_sizes}))
        say(f"measuring at {least} samples or more: layer {single_value_batchnorms(desc0)[0].index}'s BatchNorm "
            "sees a 1x1 map, which one sample cannot train")
    data, _ = open_datasets(None, desc0.img_size, desc0.in_channels)
    if classes is None and cfg_text is None:
        classes = default_classes(model, desc0.img_size)
    net, desc, text = build_model(model, desc0.img_size, classes, seed=0, cfg_text=cfg_text)
    memory = AcceleratorMemory(device, accelerator)  # before the model is there
    net.to(device)
    net.train()
    loss_fn = make_loss(desc)
    fwd, bwd, loss_f, loss_b, step_time, peak = [], [], [], [], {}, {}
    in_host = {}  # each size's peak in host memory, which the guard keeps within the host's
    saved: list[float] = []
    from swarm.data import class_targets
    from swarm.local.trainer import TrainConfig, make_optimizer, optimizer_step
    from tiles.layout import tileable_prefix

    opt = make_optimizer(net.named_parameters(), TrainConfig(optimizer=optimizer))
    runtime = None
    fits = MemoryGuard(desc, optimizer, limit=memory_limit)
    in_pieces = device == HOST and not fits(batch_sizes[0], {})
    if in_pieces:  # too big to step whole here: each layer's times from passes over pieces of the model
        measured, fwd, bwd, saved, runtime, cuts = measure_in_pieces(net, desc, loss_fn, data, batch_sizes, fits,
                                                                     budget, layer_watch, step_watch, say)
        loss_f, loss_b = [t.pop() for t in fwd], [t.pop() for t in bwd]
    else:
        measured = []
        for b in batch_sizes:
            if not fits(b, in_host):
                if not measured:
                    raise SwarmError(fits.too_small(b))
                say(f"batch {b}: skipped, it {fits.reason(b, in_host)}")
                break
            measured.append(b)
            say(f"batch {b}: whole steps")
            images, targets = make_batch(data, np.arange(b) % len(data))
            x = torch.from_numpy(images).to(device)
            tgt = torch.from_numpy(targets if desc.detects else class_targets(targets)).to(device)

            def step():
                out = net(x, list(range(b)))
                loss_fn(out, tgt, b).backward()
                optimizer_step(opt)
                opt.zero_grad(set_to_none=True)

            try:
                if runtime is None:
                    # The idle process: torch initialised by a first step, minus what the model
                    # keeps between steps (weights and optimizer state, in host memory when it computes
                    # there; gradients are freed).
                    step()
                    resident = sum(OPTIMIZER_COPIES[optimizer] * p.numel() * p.element_size() for p in net.parameters())
                    runtime = settled_rss() - (resident if device == HOST else 0)
                settled_rss()
                memory.reset_peak()
                with PeakRSS() as rss:
                    step()
            except torch.cuda.OutOfMemoryError:  # a GPU's own memory, which the guard above does not see
                measured.pop()
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                if not measured:
                    raise SwarmError(f"this device's {accelerator['note']} cannot hold a training step on {b} "
                                     f"sample{'s' if b > 1 else ''}: profile a smaller --img-size, or on the CPU "
                                     "(--accelerator cpu)") from None
                say(f"batch {b}: skipped, it does not fit in the GPU's memory")
                break
            peak[b] = memory.step_peak(float(rss.peak - runtime))
            in_host[b] = peak[b] if memory.shared or device == HOST else float(rss.peak - runtime)
            step_time[b] = median_time(step, budget, step_watch)
            say(f"batch {b}: layers")
            f, bk, lf, lb = time_in_context(net, desc, loss_fn, {-1: x}, tgt, budget, layer_watch)
            fwd.append(f)
            bwd.append(bk)
            loss_f.append(lf)
            loss_b.append(lb)
            outs = layer_inputs(net, desc, x)
            saved = saved_bytes(net, desc, outs, b)
            del outs
    say("optimizer updates")
    settled_rss()
    update = time_updates(net, desc, budget, optimizer, layer_watch)
    batch_sizes = tuple(measured)
    fit = fit_to_steps(fwd, bwd, loss_f, loss_b, sum(update), [step_time[b] for b in batch_sizes if b in step_time])
    say("the tiles executor")
    middle = batch_sizes[0 if in_pieces else len(batch_sizes) // 2]
    if in_pieces and fits.piece_need(middle, 0, tileable_prefix(desc)) > fits.SHARE * fits.limit:
        tiles_overhead = 1.0  # its front does not fit whole either
        say("the tiles executor: not measured, the model's tileable front does not fit")
    else:
        tiles_overhead = time_tiles_overhead(net, desc, middle, budget, layer_watch)
    facts = device_facts(threads, accelerator)
    where = f"{facts['name']}'s {accelerator['note']} ({accelerator['kind']}" if accelerator else \
        f"{facts['name']} ({threads} thread{'s' if threads > 1 else ''}"
    if accelerator:
        say("copies between host and accelerator")
        outs = layer_inputs(net, desc, x)  # the last batch size's
        facts["accelerator"].update(copy_gbps=copy_gbps([outs[i] for i in range(len(desc.layers))], device, budget),
                                    **memory.budget())
        del outs
    costs = CostTable(batch_sizes, np.array(fwd).T, np.array(bwd).T, update, loss_f, loss_b,
                      f"measured on {where}"
                      + (", CPU time" if clock == "cpu" else "")
                      + (f", at a quota of {quota:g} cores" if isinstance(now, QuotaClock) and not accelerator else "")
                      + (f"; layers measured in {len(cuts)} pieces, each fitted to whole passes over it: the "
                         "model is too big to step whole here)"
                         if in_pieces else f"; layers fitted to whole steps x{min(fit):.2f}-{max(fit):.2f})"),
                      tiles_overhead)
    return DeviceProfile(model=desc.name, img_size=desc.img_size, costs=costs, act_bytes=saved, device=facts,
                         classes=classes, step_time=step_time, peak_bytes=peak, runtime_bytes=float(runtime),
                         repeats=repeats, created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
