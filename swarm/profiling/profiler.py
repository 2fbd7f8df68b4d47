"""Measuring this device for the planner: per-layer forward, backward and update time at several
batch sizes, the bytes autograd keeps per layer, and the time and peak memory of whole
local steps, on the accelerator the device computes on (its CPU, or CUDA: then also the
rate of the copies between host and accelerator, and the accelerator's memory) — cached per
(device fingerprint, model, image size) in the state directory. A model too big to step
whole on this device is measured in pieces of consecutive layers that fit.

    profile, cached = load_or_profile("yolov2-16", 128, state_dir=default_state_dir())
    profile.costs.fwd_range(0, 17, 4)    # planner.profile.DeviceProfile, plain data

For the live swarm, `run_profile_job` is the agents' job kind "profile" and
`profile_devices` runs it on every agent; pairwise bandwidth comes from
swarm.profiling.bandwidth.measure_bandwidth; swarm/profiling/survey.py puts them together.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np

from planner.costs import CostTable
from planner.image_size import ImageSize
from planner.profile import DeviceProfile, ProfileError
from swarm.errors import SwarmError
from swarm.host import malloc
from swarm.host.peaks import Peaks
from swarm.host.resources import cpu_quota, usable_cores, usable_memory

DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
DEFAULT_REPEATS = 5
TIMING_BUDGET_S = 3.0  # a timing repeats (up to `repeats` times) until it has run this long: on a slow
                       # device one multi-second step is as exact as five, and five cost minutes
OPTIMIZER_COPIES = {"sgd": 2, "adam": 3}  # weights + optimizer state, in floats per parameter
PROFILE_METHOD = 5  # 4: layers timed in CPU time under a quota, fitted to whole steps; the tiles executor's
                    # overhead; 5: saved bytes of in-place activations and byte-coded max-pools
                    # (profiles measured otherwise are measured again)
CANNOT_PROFILE = "cannot profile the model"  # the model is too big to measure whole on this device
FIT_LIMITS = (0.5, 2.0)  # a fit beyond these says the measurements disagree: keep the layers' own sum


def default_state_dir() -> Path:
    """Where swarm keeps its state (swarm.host.state: --state-dir, $SWARM_STATE_DIR, /var/lib/swarm
    as root, else ~/.local/share/swarm); profiles go to its profiles/ folder."""
    from swarm.host.state import default_state_dir as runtime_state_dir

    return runtime_state_dir()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_facts(threads: int, accelerator: dict | None = None) -> dict:
    """What decides this device's speed, and a fingerprint of it (cached profiles are per
    fingerprint: other CPU, quota, thread count, torch or accelerator means profiling again).
    `accelerator`: what `accelerator_identity` says of the one the layers run on (None: the CPU)."""
    facts = {"cpu": _cpu_name(), "machine": platform.machine(), "cores": usable_cores(), "cpu_quota": cpu_quota(),
             "threads": threads, "torch": _torch_version(), "allocator": malloc.allocator()}
    if facts["cpu_quota"] is not None:
        facts["timing"] = "quota"  # measured with QuotaClock
    if accelerator is not None:
        facts["accelerator"] = dict(accelerator)
    facts["method"] = PROFILE_METHOD
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    facts.update(fingerprint=digest, memory=usable_memory(), name=platform.node())
    return facts


def _torch_version() -> str:
    """torch's version without importing it (reading a cached profile should not load torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        import torch

        return torch.__version__


def cache_path(state_dir: Path, fingerprint: str, model: str, img_size: ImageSize, classes: int | None,
               cfg_text: str) -> Path:
    cfg = hashlib.sha256(cfg_text.encode()).hexdigest()[:8]
    return Path(state_dir) / "profiles" / fingerprint / f"{model}-{img_size.to_json()}-c{classes}-{cfg}.json"


def default_classes(model: str, img_size: ImageSize | int | None = None) -> int | None:
    """The head's classes when none are given, as `swarm train` picks them: a built-in
    detector gets the built-in data's classes; anything else keeps its .cfg's."""
    from swarm.data import open_datasets
    from swarm.zoo import BUILTIN, describe_model

    if model not in BUILTIN:
        return None
    desc = describe_model(model, img_size)
    if desc.loss != "region":
        return None
    return open_datasets(None, desc.img_size, desc.in_channels)[0].num_classes


def accelerator_identity(device) -> dict | None:
    """The accelerator a torch device is, in the cluster file's words (None: the host CPU):
    {"kind": "cuda", "note": its name, "shared_memory": whether it shares the host's memory}.
    A Jetson's GPU is integrated (torch says so): one memory with its CPU."""
    if device.type != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"kind": "cuda", "note": props.name, "shared_memory": bool(props.is_integrated)}


# ---- measuring ---------------------------------------------------------------------------

CLOCKS = {
    "wall": time.perf_counter,
    # this thread's CPU time: what one thread computes, whatever else shares the machine
    # (one compute thread only; for measuring on a busy machine)
    "cpu": time.thread_time,
}


class QuotaClock:
    """Wall time as a cgroup CPU quota makes it. Under a quota of q cores a computation runs at
    full speed until the period's share is spent, then waits for the next period; a short
    timing (one layer) mostly misses the waits, so medians of them tell the speed of the
    host's core, not the device's. This clock advances by the larger of the wall time and the
    process's CPU time / q since it was last read: a layer costs what it costs once the quota
    is spread over a long run, as in training."""

    def __init__(self, quota: float):
        self.quota = quota
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.value = 0.0

    def __call__(self) -> float:
        wall, cpu = time.perf_counter(), time.process_time()
        self.value += max(wall - self.wall, (cpu - self.cpu) / self.quota)
        self.wall, self.cpu = wall, cpu
        return self.value


class QuotaCPUClock:
    """CPU time spread over a quota of q cores: the process's CPU seconds / q. For timings
    too short to meet the throttling evenly (a layer), where QuotaClock's larger-of-the-two
    rounds each one up; whole steps, timed with QuotaClock, still see a busy host."""

    def __init__(self, quota: float):
        self.quota = quota

    def __call__(self) -> float:
        return time.process_time() / self.quota


class Stopwatch:
    """Marks on the timeline of the device that computes, and the seconds between them. On
    CUDA a mark is an event recorded on the current stream, so the time is the GPU's between
    the marks, not the host's queueing of kernels; `settle` waits for them before any reading.
    Elsewhere a mark is a reading of the clock `now`."""

    def __init__(self, device, now=time.perf_counter):
        self.device, self.now = device, now
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return self.now()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def settle(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def seconds(self, start, end) -> float:
        """Between two marks (settled)."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class ProfileStopped(SwarmError):
    """The profile was called off (its job released) before it was done."""


class Budget(NamedTuple):
    """How far each timing goes: up to `repeats` runs, as many as fit in TIMING_BUDGET_S, and
    none once `stop` is set (a profile job released while it measures)."""
    repeats: int
    stop: threading.Event | None = None


def _median_time(fn, budget: Budget, watch: Stopwatch) -> float:
    """Median seconds of up to `budget.repeats` calls: as many as run within TIMING_BUDGET_S (at least one)."""
    marks = []
    for _ in _within_budget(budget):
        t0 = watch.mark()
        fn()
        marks.append((t0, watch.mark()))
    watch.settle()
    return statistics.median(watch.seconds(a, b) for a, b in marks)


def _within_budget(budget: Budget):
    """0, 1, ... up to `budget.repeats` - 1, stopping once TIMING_BUDGET_S of wall time has passed
    since the first (which always runs); ProfileStopped before any run once `budget.stop` is set."""
    start = time.perf_counter()
    for r in range(budget.repeats):
        if budget.stop is not None and budget.stop.is_set():
            raise ProfileStopped("the profile was called off")
        if r and time.perf_counter() - start >= TIMING_BUDGET_S:
            return
        yield r


def settled_rss() -> int:
    """Resident bytes after handing freed memory back to the system (the allocator keeps
    freed blocks otherwise, and the idle size would include the last step's activations)."""
    import psutil

    malloc.release()
    return psutil.Process().memory_info().rss


class _PeakRSS(Peaks):
    """Samples this process's resident memory in a thread; `peak` is the largest seen."""

    def __init__(self, interval: float = 0.001):
        import psutil

        process = psutil.Process()
        super().__init__(lambda: process.memory_info().rss, interval)


def _layer_inputs(net, desc, images: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every layer's output (and the image as -1) for one batch, without autograd."""
    import torch

    with torch.no_grad():
        outs = {-1: images}  # uint8: the first layer's time includes turning it into floats, as in training
        for i in range(len(desc.layers)):
            outs.update(net.forward_range(i, i + 1, {s: outs[s] for s in desc.live_after(i)},
                                          keys=list(range(len(images)))))
    return outs


def _time_in_context(net, desc, loss_fn, live, targets, budget: Budget, watch: Stopwatch,
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
    for _ in itertools.chain(["warm-up"], _within_budget(budget)):  # the first run warms up
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


def _time_pass(net, desc, loss_fn, live, targets, first: int, last: int, budget: Budget, watch: Stopwatch) -> float:
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
    return _median_time(one_pass, budget, watch)


def _measure_in_pieces(net, desc, loss_fn, data, batch_sizes, fits: "MemoryGuard", budget: Budget,
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
            with _PeakRSS() as rss:
                pf, pb, lf, lb = _time_in_context(net, desc, loss_fn, live, tgt, budget, watch, first, last)
            fits.base = settled_rss()
            fits.measured_piece(b, first, last, float(rss.peak))
            lf, lb = [lf], [lb]
            _fit_to_steps([pf], [pb], lf, lb, 0.0, [_time_pass(net, desc, loss_fn, live, tgt, first, last, budget,
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
            saved[first:last] = _saved_bytes(net, desc, outs, b, range(first, last))
            live = {s: outs[s] for s in desc.live_after(last)} if last < L else {}
            del outs
        fwd.append(f)
        bwd.append(bk)
    return measured, fwd, bwd, saved, float(runtime), first_cuts


def _saved_bytes(net, desc, outs, batch: int, layers=None) -> list[float]:
    """Bytes each layer (of `layers`, default all) keeps for the backward, per sample (saved
    tensors, each storage once, charged to the first layer that keeps it; parameters
    excluded, and a layer's input when the layer that made it keeps it already as its
    activation's result). `outs`: every map those layers read."""
    import torch

    from planner.memory import input_kept_upstream

    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    upstream = input_kept_upstream(desc)
    keys = list(range(batch))
    saved = []
    for i in range(len(desc.layers)) if layers is None else layers:
        seen: dict[int, int] = {}
        inputs = {s: outs[s] if s < 0 else outs[s].detach().requires_grad_(True) for s in desc.live_after(i)}
        skip = set(params)
        if i in upstream:
            skip.update(inputs[s].untyped_storage().data_ptr() for s in desc.layers[i].inputs)

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in skip and key not in seen:
                seen[key] = t.untyped_storage().nbytes()
            # detached: a layer that saves its own output (an in-place activation's result)
            # would otherwise hold its graph in a cycle through autograd's nodes, which
            # Python's collector cannot see, and every layer's activations would stay alive
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            net.forward_range(i, i + 1, inputs, keys)
        saved.append(sum(seen.values()) / batch)
    return saved


def _time_updates(net, desc, budget: Budget, optimizer: str, watch: Stopwatch) -> list[float]:
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
            out.append(_median_time(lambda: optimizer_step(opt), budget, watch))
            for (_, p), b in zip(named, before):
                p.copy_(b)
        for _, p in named:
            p.grad = None
        del opt, before
        malloc.give_back()
    return out


def profile_model(model: str = "yolov2-16", img_size: ImageSize | int | None = None, classes: int | None = None,
                  batch_sizes=DEFAULT_BATCH_SIZES, repeats: int = DEFAULT_REPEATS, threads: int | None = None,
                  cfg_text: str | None = None, optimizer: str = "sgd", log=None, clock: str = "wall",
                  device=None, stop: threading.Event | None = None) -> DeviceProfile:
    """Measure this device running `model` on `device` (a torch.device; None: the host CPU),
    with the built-in synthetic data for inputs. clock "cpu" counts this thread's CPU time
    instead of the wall clock (one thread only, on the CPU); on CUDA, CUDA events time the
    work. A model too big to step whole in the host's memory is measured in pieces
    (_measure_in_pieces)."""
    import torch

    from swarm.data import make_batch, open_datasets
    from swarm.local.compute_device import HOST
    from swarm.zoo import build_model, describe_model
    from swarm.zoo.loss import make_loss

    batch_sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
    if not batch_sizes or batch_sizes[0] < 1:
        raise SwarmError(f"batch sizes to profile must be positive, got {batch_sizes}")
    if repeats < 1:
        raise SwarmError(f"--repeats must be at least 1, got {repeats}")
    budget = Budget(repeats, stop)
    threads = threads or usable_cores()
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
    data, _ = open_datasets(None, desc0.img_size, desc0.in_channels)
    if classes is None and cfg_text is None:
        classes = default_classes(model, desc0.img_size)
    net, desc, text = build_model(model, desc0.img_size, classes, seed=0, cfg_text=cfg_text)
    memory = AcceleratorMemory(device, accelerator)  # before the model is there
    net.to(device)
    net.train()
    loss_fn = make_loss(desc)
    say = log or (lambda _msg: None)
    fwd, bwd, loss_f, loss_b, step_time, peak = [], [], [], [], {}, {}
    in_host = {}  # each size's peak in host memory, which the guard keeps within the host's
    saved: list[float] = []
    from swarm.data import class_targets
    from swarm.local.trainer import TrainConfig, make_optimizer, optimizer_step
    from tiles.layout import tileable_prefix

    opt = make_optimizer(net.named_parameters(), TrainConfig(optimizer=optimizer))
    runtime = None
    fits = MemoryGuard(desc, optimizer)
    in_pieces = device == HOST and not fits(batch_sizes[0], {})
    if in_pieces:  # too big to step whole here: each layer's times from passes over pieces of the model
        measured, fwd, bwd, saved, runtime, cuts = _measure_in_pieces(net, desc, loss_fn, data, batch_sizes, fits,
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
                with _PeakRSS() as rss:
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
            step_time[b] = _median_time(step, budget, step_watch)
            say(f"batch {b}: layers")
            f, bk, lf, lb = _time_in_context(net, desc, loss_fn, {-1: x}, tgt, budget, layer_watch)
            fwd.append(f)
            bwd.append(bk)
            loss_f.append(lf)
            loss_b.append(lb)
            outs = _layer_inputs(net, desc, x)
            saved = _saved_bytes(net, desc, outs, b)
            del outs
    say("optimizer updates")
    settled_rss()
    update = _time_updates(net, desc, budget, optimizer, layer_watch)
    batch_sizes = tuple(measured)
    fit = _fit_to_steps(fwd, bwd, loss_f, loss_b, sum(update), [step_time[b] for b in batch_sizes if b in step_time])
    say("the tiles executor")
    middle = batch_sizes[0 if in_pieces else len(batch_sizes) // 2]
    if in_pieces and fits.piece_need(middle, 0, tileable_prefix(desc)) > fits.SHARE * fits.limit:
        tiles_overhead = 1.0  # its front does not fit whole either
        say("the tiles executor: not measured, the model's tileable front does not fit")
    else:
        tiles_overhead = _time_tiles_overhead(net, desc, middle, budget, layer_watch)
    facts = device_facts(threads, accelerator)
    where = f"{facts['name']}'s {accelerator['note']} ({accelerator['kind']}" if accelerator else \
        f"{facts['name']} ({threads} thread{'s' if threads > 1 else ''}"
    if accelerator:
        say("copies between host and accelerator")
        outs = _layer_inputs(net, desc, x)  # the last batch size's
        facts["accelerator"].update(copy_gbps=_copy_gbps([outs[i] for i in range(len(desc.layers))], device, budget),
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


class AcceleratorMemory:
    """A step's memory on the device that computes. On the CPU: the host's resident memory.
    On a discrete GPU: the most torch allocated on it, out of its own memory (what is free
    there once CUDA is up is its budget). On an integrated one (a Jetson), CPU and GPU take
    from one memory: the host's share and the GPU's add up, against the device's one budget,
    counted once."""

    def __init__(self, device, accelerator: dict | None):
        self.device = device
        self.cuda = accelerator is not None
        self.shared = bool(accelerator and accelerator["shared_memory"])
        self.free = None
        if self.cuda:
            import torch

            torch.zeros(1, device=device)  # CUDA up: its context is not the model's
            self.free = torch.cuda.mem_get_info(device)[0]

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_peak(self, host_peak: float) -> float:
        """The step's peak bytes, given the host's above the runtime."""
        if not self.cuda:
            return host_peak
        import torch

        on_gpu = float(torch.cuda.max_memory_allocated(self.device))
        return host_peak + on_gpu if self.shared else on_gpu

    def budget(self) -> dict:
        """The accelerator's memory as a cluster file gives it: its own, or shared with the host."""
        return {"shared_memory": True} if self.shared else {"shared_memory": False, "memory": int(self.free)}


def _copy_gbps(tensors, device, budget: Budget) -> float:
    """GB/s of the copies that take a stage's messages between host memory and `device`:
    each of `tensors` (the layers' outputs: what a stage takes in and gives out) taken to the
    device as an incoming message is, and brought back as an outgoing one is (`to_host`),
    median of `budget.repeats` passes over all of them, by the wall clock (copies run on streams of
    their own)."""
    from swarm.local.compute_device import HOST, to_host

    hosted = [to_host(t).contiguous() for t in tensors]
    nbytes = 2 * sum(t.numel() * t.element_size() for t in hosted)

    def there_and_back():
        for t in hosted:
            to_host(t.to(device, non_blocking=True, copy=True))

    there_and_back()  # warm up (pinned buffers, the copy stream)
    seconds = _median_time(there_and_back, budget, Stopwatch(HOST))
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


class MemoryGuard:
    """Which batch sizes this process can profile without outgrowing its memory (a cgroup
    limit on a small device: profiling past it gets the whole agent killed). A batch size is
    run when the resident size now, plus its predicted peak above that, stays within a share
    of the usable memory. The peak is predicted per sample from the largest measured so far,
    or before any measurement from the memory model's estimate, with a margin for what
    neither sees (the allocator's slack, the temporaries of a backward); before the first
    step, also the gradients and optimizer state that step allocates (a model of 50 M
    parameters holds 400 MB of them under SGD, which a 1 GiB device does not have beside the
    model, its activations and the agent)."""

    SHARE = 0.85  # of usable memory; the rest is the agent's own and the kernel's
    MARGIN = 1.3  # measured peaks run 1.3-1.4x the estimate; measured per-sample peaks vary by ~1.2x

    def __init__(self, desc, optimizer: str, limit: int | None = None):
        from planner.memory import MemoryModel

        n = len(desc.layers)
        self.model = model = MemoryModel.estimated(desc, optimizer)
        self.estimate = model.activations(0, n, 1) + model.buffers(0, n, 1)  # bytes per sample
        self.state = OPTIMIZER_COPIES[optimizer] * sum(d.param_bytes for d in desc.layers)  # gradients, slots
        self.limit = limit if limit is not None else usable_memory()
        self.base = settled_rss()
        self.piece_extra = 0.0  # what pieces measured so far held beyond their estimate

    def per_sample(self, peak: dict[int, float]) -> float:
        return max((v / b for b, v in peak.items()), default=1.4 * self.estimate)

    def need(self, batch: int, peak: dict[int, float]) -> float:
        first = 0.0 if peak else self.state  # a measured peak includes them
        return self.base + first + self.MARGIN * batch * self.per_sample(peak)

    def __call__(self, batch: int, peak: dict[int, float]) -> bool:
        return self.need(batch, peak) <= self.SHARE * self.limit

    def reason(self, batch: int, peak: dict[int, float]) -> str:
        return (f"would need about {self.need(batch, peak) / 2**20:.0f} MiB of this device's "
                f"{self.limit / 2**20:.0f} MiB")

    def too_small(self, batch: int, layer: int | None = None) -> str:
        what = "a step" if layer is None else f"layer {layer} alone"
        need = self.need(batch, {}) if layer is None else self.piece_need(batch, layer, layer + 1)
        return (f"this device {CANNOT_PROFILE}: {what} on {batch} sample{'s' if batch > 1 else ''} would need "
                f"about {need / 2**20:.0f} MiB of this device's {self.limit / 2**20:.0f} MiB; profile a smaller "
                "--img-size or describe the device with --devices CLUSTER.json")

    # ---- a model too big to measure whole: its layers in pieces ---------------------------
    def piece_need(self, batch: int, first: int, last: int) -> float:
        """A training pass over layers [first, last) alone, on `batch` samples: the model
        (in the resident size already), the piece's gradients, what passes measured so far
        held beyond their estimate, and, with the margin, the piece's saved activations, its
        largest backward's buffers and the maps it takes in."""
        return self.base + float(self.model.param_bytes[first:last].sum()) + self.piece_extra \
            + self.MARGIN * 1.4 * batch * self._piece_per_sample(first, last)

    def _piece_per_sample(self, first: int, last: int) -> float:
        m = self.model
        return m.activations(first, last, 1) + m.buffers(first, last, 1) + m.boundary(first)

    def measured_piece(self, batch: int, first: int, last: int, peak: float) -> None:
        """Passes over a piece peaked at `peak` resident bytes, and the process has settled
        back to `self.base` since (what the first pass keeps for good, torch's own buffers,
        is in the base from then on): what they held beyond the estimate is held by every
        later piece too (kernel scratch, the allocator's slack; at small sizes it is most
        of a peak and does not grow with the batch)."""
        expected = float(self.model.param_bytes[first:last].sum()) + 1.4 * batch * self._piece_per_sample(first, last)
        self.piece_extra = max(self.piece_extra, peak - self.base - expected)

    def pieces(self, batch: int) -> list[tuple[int, int]] | None:
        """The fewest contiguous layer ranges, each measured alone within the share of memory
        (greedy from the first layer: the longest piece that fits, then the next); None when
        some layer alone does not fit."""
        n, out, first = len(self.model.desc.layers), [], 0
        while first < n:
            last = first
            while last < n and self.piece_need(batch, first, last + 1) <= self.SHARE * self.limit:
                last += 1
            if last == first:
                return None
            out.append((first, last))
            first = last
        return out

    def first_too_big(self, batch: int) -> int:
        """The first layer that does not fit alone on `batch` samples."""
        n = len(self.model.desc.layers)
        return next(i for i in range(n) if self.piece_need(batch, i, i + 1) > self.SHARE * self.limit)


def _time_tiles_overhead(net, desc, batch: int, budget: Budget, watch: Stopwatch) -> float:
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

    def untiled():
        y = x
        for layer in layers:
            y = layer(y)
        (y * dy).sum().backward()
        net.zero_grad(set_to_none=True)

    def tiled():
        stage.forward(0, x, (batch,))
        stage.backward(0, dy)
        net.zero_grad(set_to_none=True)

    untiled(), tiled()  # warm up
    base = _median_time(untiled, budget, watch)
    return _median_time(tiled, budget, watch) / base if base > 0 else 1.0


def _fit_to_steps(fwd, bwd, loss_f, loss_b, update: float, steps: list[float]) -> list[float]:
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


# ---- the cache ---------------------------------------------------------------------------

def read_profile(path: Path) -> DeviceProfile:
    try:
        return DeviceProfile.from_dict(json.loads(Path(path).read_text()))
    except OSError as exc:
        raise SwarmError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SwarmError(f"profile {path} is not valid JSON: {exc}") from None
    except ProfileError as exc:
        raise SwarmError(f"{path}: {exc}") from None


def write_profile(profile: DeviceProfile, path: Path) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # writers may race
        tmp.write_text(json.dumps(profile.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        raise SwarmError(f"cannot write profile {path}: {exc.strerror or exc}; choose another --state-dir") from None


def load_or_profile(model: str = "yolov2-16", img_size: ImageSize | int | None = None, classes: int | None = None,
                    state_dir: Path | None = None, batch_sizes=DEFAULT_BATCH_SIZES, repeats: int = DEFAULT_REPEATS,
                    threads: int | None = None, cfg_text: str | None = None, refresh: bool = False,
                    log=None, clock: str = "wall", accelerator: str = "cpu",
                    stop: threading.Event | None = None) -> tuple[DeviceProfile, bool, Path]:
    """The cached profile of this device for the model on `accelerator` ("cpu" or "cuda",
    as swarm.local.compute_device takes it), or a fresh one (then cached); a fresh one raises
    ProfileStopped once `stop` is set.
    Returns (profile, came from the cache, its path)."""
    from swarm.local.compute_device import compute_device
    from swarm.zoo import describe_model, model_source

    if cfg_text is None:
        _, cfg_text, _ = model_source(model)
        if classes is None:
            classes = default_classes(model, img_size)
    desc = describe_model(model, img_size, None, cfg_text)
    threads = threads or usable_cores()
    device = compute_device(accelerator)
    facts = device_facts(threads, accelerator_identity(device))
    path = cache_path(Path(state_dir or default_state_dir()), facts["fingerprint"], desc.name, desc.img_size,
                      classes, cfg_text)
    if clock != "wall":
        path = path.with_name(path.stem + f"-{clock}" + path.suffix)
    if path.exists() and not refresh:
        try:
            return read_profile(path), True, path
        except SwarmError:
            pass  # a stale or broken cache entry: measure again
    profile = profile_model(model, desc.img_size, classes, batch_sizes, repeats, threads, cfg_text, log=log,
                            clock=clock, device=device, stop=stop)
    write_profile(profile, path)
    return profile, False, path


# ---- the live swarm -----------------------------------------------------------------------

PROFILE_JOB = "profile"


async def run_profile_job(ctx) -> dict:
    """Job kind "profile", agent side: this device's profile (from its cache, else measured;
    measured again if "refresh") for spec {"model", "img_size" (N or "WxH"), "classes", "cfg",
    "batch_sizes", "repeats", "threads", "refresh", "accelerator"}, on the accelerator the
    agent offers ("accelerator": "cuda") where torch can use it, else on its CPU."""
    import functools

    spec = ctx.spec
    stop = threading.Event()  # released while it measures: the thread gives up at its next timing
    call = functools.partial(load_or_profile, spec["model"], spec.get("img_size"), spec.get("classes"), None,
                             tuple(spec.get("batch_sizes") or DEFAULT_BATCH_SIZES),
                             int(spec.get("repeats") or DEFAULT_REPEATS), spec.get("threads"), spec.get("cfg"),
                             bool(spec.get("refresh")), accelerator=usable_accelerator(spec.get("accelerator")),
                             stop=stop)
    profile, cached, _ = await ctx.run_in_thread(call, stop=stop)
    return {"profile": profile.to_dict(), "cached": cached}


def usable_accelerator(offered: str | None) -> str:
    """What a profile measures on: "cuda" where the agent offers it and torch can use it (an
    agent tells from the device's files, without torch), else "cpu"."""
    if offered != "cuda":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


async def profile_devices(cluster, node_ids: list[str], spec: dict, timeout: float = 3600.0,
                          accelerators: dict[str, str] | None = None) -> dict:
    """Coordinator side: the profile job on every node at once, each on the accelerator it
    offers (`accelerators`: {node id: "cpu" | "cuda"}, as advertised); {node id: DeviceProfile}."""
    import secrets

    import trio

    job = cluster.job(f"profile-{secrets.token_hex(4)}", 0)
    profiles = {}
    try:
        await job.assign_and_start(PROFILE_JOB, {
            node: dict(spec, accelerator=(accelerators or {}).get(node, "cpu")) for node in node_ids},
            all_or_raise=True)
        with trio.fail_after(timeout):
            for node in node_ids:
                result = await job.wait_done(node)
                try:
                    profiles[node] = DeviceProfile.from_dict(result["profile"])
                except (KeyError, ProfileError) as exc:
                    raise SwarmError(f"the profile from {node} is unusable: {exc}") from None
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await job.release_all()
    return profiles
