"""The local reference trainer: the answer every distributed plan must reproduce.

One step takes the seeded mini-batch for that step, splits it into micro-batches, runs
forward and backward on each (BatchNorm statistics per micro-batch, gradients
accumulated, loss = sum over samples / mini-batch size), then takes one optimizer step.
"""
from __future__ import annotations

import json
import math
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from planner.image_size import ImageSize
from swarm.data import (class_targets, microbatch_bounds, open_datasets, sample_keys, training_batch,
                        steps_per_epoch)
from swarm.errors import SwarmError
from swarm.host.resources import compute_threads
from swarm.data.augment import Augment, Augmenter
from swarm.local.checkpoint import load_initial_weights, save_checkpoint
from swarm.local.compute_device import compute_device
from swarm.local.progress import Progress
from swarm.zoo import BUILTIN, DEFAULT_MODEL, build_model
from swarm.zoo.loss import make_loss


@dataclass
class TrainConfig:
    """Everything that decides the trained weights (and a few things that do not)."""

    model: str = DEFAULT_MODEL
    img_size: ImageSize | None = None  # width x height; None: the model's own size ([net] width, height)
    data: str | None = None  # None: the built-in synthetic shapes
    batch_size: int = 16
    microbatches: int = 1  # gradient accumulation; BatchNorm statistics per micro-batch
    steps: int | None = None  # total optimizer steps (None: from epochs, or the default)
    epochs: float | None = None
    optimizer: str = "sgd"  # sgd (momentum, weight decay) or adam
    lr: float | None = None  # None: 0.001 (SGD and Adam alike)
    momentum: float = 0.9
    weight_decay: float = 5e-4  # on conv and fully-connected weights only, as darknet does
    warmup: int = 20  # steps of linear learning-rate warm-up
    # steps from which the learning rate is a tenth as large again (darknet's policy=steps with
    # scales .1); None: at 80% and 90% of the run, set when it starts (resolve_lr_drops)
    lr_drops: list[int] | None = None
    seed: int = 0  # initial weights and the order of samples
    classes: int | None = None  # built-in models: None means the data set's number of classes
    dtype: str = "float32"  # float64: slower, but any plan then matches local to ~1e-12 (see README)
    weights: str | None = None  # darknet .weights or swarm checkpoint loaded over the seeded initial weights
    augment: bool = True  # the cfg's augmentation options (jitter, flip, hue, ...); False: samples as they are
    # [yolo] anchors: "cfg" as the .cfg writes them, "auto" fitted to the training boxes when a
    # run starts (written into the checkpoint's cfg text, which eval, detect and export read)
    anchors: str = "cfg"
    accelerator: str | None = None  # where this machine computes: cpu, cuda, None: its accelerator if torch sees one

    def __post_init__(self) -> None:
        if self.img_size is not None:  # an int (square), "WxH" or {"width", "height"} from a saved config
            self.img_size = ImageSize.of(self.img_size)

    def to_dict(self) -> dict:
        """The config as plain data (checkpoints, job specs); TrainConfig(**d) reads it back."""
        d = asdict(self)
        d["img_size"] = None if self.img_size is None else self.img_size.to_json()
        return d

    def resolved_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 0.001

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based): linear warm-up, then constant,
        a tenth as large from each of `lr_drops` on. It depends on the step alone, so a resumed
        run follows the same schedule."""
        base = self.resolved_lr() * 0.1 ** sum(step >= drop for drop in self.lr_drops or ())
        if self.warmup > 0 and step < self.warmup:
            return base * (step + 1) / self.warmup
        return base

    def resolve_lr_drops(self, total_steps: int) -> None:
        """Fix the default drops at 80% and 90% of a run of `total_steps` (darknet's yolo cfgs
        drop at 80% and 90% of max_batches), before the config goes to any device."""
        if self.lr_drops is None:
            self.lr_drops = [int(total_steps * 0.8), int(total_steps * 0.9)] if total_steps >= 10 else []


DEFAULT_STEPS = 300
SAVE_EVERY_S = 600.0  # a run on this machine writes its checkpoint at least this often (seconds)


def torch_dtype(name: str) -> torch.dtype:
    if name not in ("float32", "float64"):
        raise SwarmError(f"--dtype must be float32 or float64, not {name}")
    return torch.float32 if name == "float32" else torch.float64


def decay_groups(named_params) -> list[dict]:
    """Weight decay applies to conv and fully-connected weights, not biases or BN."""
    decay, no_decay = [], []
    for _, p in named_params:
        (decay if p.dim() > 1 else no_decay).append(p)
    return [{"params": decay, "decay": True}, {"params": no_decay, "decay": False}]


OPTIMIZER_METHODS = ("__init__", "add_param_group", "zero_grad", "state_dict", "load_state_dict")


def optimizers_without_dynamo() -> None:
    """Let torch.optim's optimizers be built, saved and loaded without importing torch._dynamo.

    torch wraps these methods so that torch.compile does not trace into them, and the wrapper
    imports torch._dynamo the first time one is called: 1.6 s of CPU (16 s on a 0.1-core
    device, before its first step) and 71 MiB resident, 7% of a 1 GiB device, for a compiler
    swarm never uses. Each wrapper looks for the disabled function it made before; this gives
    it one that calls the method directly, or through torch._dynamo if it is ever called
    while compiling. (`optimizer_step` does the same for a step.) Where torch's wrappers are not
    as described (another version), nothing changes."""
    for name in OPTIMIZER_METHODS:
        method = getattr(torch.optim.Optimizer, name, None)
        original = getattr(method, "__wrapped__", None)
        if original is None or not method.__code__.co_filename.endswith("_compile.py"):
            continue
        if getattr(original, "__dynamo_disable", None) is None:
            original.__dynamo_disable = _direct(original)


def _direct(fn):
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            from torch import _dynamo

            return _dynamo.disable(fn, wrapping=False)(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """optimizer.step(), without the import of torch._dynamo that torch's wrapper of every
    step makes (for a graph break that only matters while compiling): the step itself,
    under no_grad as the wrapper runs it. The wrappers also call step hooks; with any
    registered, or a differentiable optimizer, or wrappers not as described, it is the
    plain optimizer.step()."""
    from torch.optim import optimizer as torch_optimizer

    hooked = type(optimizer).step
    inner = getattr(hooked, "__wrapped__", None)
    raw = getattr(inner, "__wrapped__", None)
    if raw is None or getattr(inner, "__name__", "") != "step" or inner.__code__.co_name != "_use_grad" \
            or optimizer.defaults.get("differentiable") or optimizer._optimizer_step_pre_hooks \
            or optimizer._optimizer_step_post_hooks or torch_optimizer._global_optimizer_pre_hooks \
            or torch_optimizer._global_optimizer_post_hooks or torch.compiler.is_compiling():
        optimizer.step()
        return
    with torch.no_grad():
        raw(optimizer)


def make_optimizer(named_params, cfg: TrainConfig) -> torch.optim.Optimizer:
    optimizers_without_dynamo()
    groups = decay_groups(named_params)
    for g in groups:
        g["weight_decay"] = cfg.weight_decay if g.pop("decay") else 0.0
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.resolved_lr(), momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.resolved_lr())
    raise SwarmError(f"unknown optimizer '{cfg.optimizer}'; use sgd or adam")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


class LocalTrainer:
    """Holds the network, its optimizer and the data; `step()` trains one mini-batch."""

    def __init__(self, cfg: TrainConfig, cfg_text: str | None = None, state: dict | None = None):
        self.cfg = cfg
        self.net, self.desc, self.cfg_text = build_model(cfg.model, cfg.img_size, cfg.classes, cfg.seed, cfg_text)
        cfg.img_size = self.desc.img_size
        self.device = compute_device(cfg.accelerator)
        self.net.to(self.device, torch_dtype(cfg.dtype))
        self.net.train()
        self.loss_fn = make_loss(self.desc)
        self.augment = Augment.from_cfg(self.cfg_text, cfg.model) if cfg.augment else Augment()
        self.augmenter = Augmenter(self.augment, cfg.seed, not self.desc.detects) if self.augment.active else None
        self.optimizer = make_optimizer(self.net.named_parameters(), cfg)
        self.step_count = 0
        self.started_from = None  # what --weights loaded, in words
        if state is None and cfg.weights:
            self.started_from = load_initial_weights(self.net, cfg.weights)
        if state is not None:
            try:
                self.net.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            except (RuntimeError, ValueError, KeyError) as exc:
                raise SwarmError(f"the checkpoint does not fit model {cfg.model}: {exc}") from None
            self.step_count = int(state["step"])

    def state(self) -> dict:
        return {
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step_count,
            "model_name": self.cfg.model if self.cfg.model in BUILTIN else self.desc.name,
            "img_size": self.desc.img_size.to_json(),
            # where it ran is not part of what it is: a resumed run computes where it resumes
            "config": {k: v for k, v in self.cfg.to_dict().items() if v is not None and k != "accelerator"},
            "cfg": self.cfg_text,
        }

    def targets_for_loss(self, targets: np.ndarray) -> torch.Tensor:
        if self.desc.detects:
            return torch.from_numpy(targets).to(self.device, self.net.dtype)
        return torch.from_numpy(class_targets(targets)).to(self.device)

    def forward_backward(self, images: np.ndarray, targets: np.ndarray, keys: list[int], batch_total: int) -> float:
        """Forward and backward of one micro-batch, accumulating gradients; returns its loss
        (already divided by the mini-batch size). Other execution modes override this."""
        out = self.net(torch.from_numpy(images).to(self.device, non_blocking=True), keys)
        loss = self.loss_fn(out, self.targets_for_loss(targets), batch_total)
        loss.backward()
        return float(loss.detach())

    def step(self, images: np.ndarray, targets: np.ndarray) -> float:
        """One optimizer step on a mini-batch; returns the mini-batch loss."""
        cfg = self.cfg
        bsz = len(images)
        total = 0.0
        keys = sample_keys(self.step_count, range(bsz))
        for lo, hi in microbatch_bounds(bsz, cfg.microbatches):
            total += self.forward_backward(images[lo:hi], targets[lo:hi], keys[lo:hi], bsz)
        if not math.isfinite(total):
            raise SwarmError(f"the loss became {total} at step {self.step_count + 1}; "
                             f"try a smaller --lr (now {cfg.resolved_lr()}) or a longer --warmup")
        set_lr(self.optimizer, cfg.lr_at(self.step_count))
        optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return total


def resolve_steps(cfg: TrainConfig, n_train: int) -> int:
    per_epoch = steps_per_epoch(n_train, cfg.batch_size)
    if cfg.steps is not None:
        if cfg.steps < 1:
            raise SwarmError(f"--steps must be at least 1, got {cfg.steps}")
        return cfg.steps
    if cfg.epochs is not None:
        if cfg.epochs <= 0:
            raise SwarmError(f"--epochs must be positive, got {cfg.epochs}")
        return max(1, int(round(cfg.epochs * per_epoch)))
    return DEFAULT_STEPS


def set_threads(threads: int | None) -> int:
    n = threads or compute_threads()
    if n < 1:
        raise SwarmError(f"--threads must be at least 1, got {n}")
    torch.set_num_threads(n)
    return n


def check_classes(desc, cfg: TrainConfig, train) -> None:
    have = desc.extra["classes"]
    if train.num_classes > have:
        raise SwarmError(f"the data has {train.num_classes} classes but model {cfg.model} predicts {have}; "
                         f"give --classes {train.num_classes} or edit the .cfg")


def prepare(cfg: TrainConfig, cfg_text: str | None = None):
    """Fill in defaults that depend on the model and data; returns (cfg, train, heldout)."""
    from swarm.zoo import default_img_size, describe_model

    cfg.img_size = default_img_size(cfg.model, cfg.img_size)  # the same with --data: no silent change of size
    desc0 = describe_model(cfg.model, cfg.img_size, None, cfg_text)
    train_set, heldout = open_datasets(cfg.data, desc0.img_size, desc0.in_channels)
    if desc0.detects and getattr(train_set, "task", "detect") == "classify":
        raise SwarmError(f"{cfg.data} holds one folder of images per class, which trains a classifier; {cfg.model} "
                         "is a detector and needs boxes: give a folder in the YOLO layout (`swarm data sample DIR` "
                         "writes one)")
    if cfg.classes is None and cfg.model in BUILTIN:
        cfg.classes = train_set.num_classes
    return cfg, train_set, heldout


def fit_cfg_anchors(cfg: TrainConfig, train_set, log=print) -> str:
    """The model's .cfg text with its [yolo] anchors fitted to the training boxes (k-means with
    IoU, as darknet's calc_anchors) at the training size; SwarmError for a model without [yolo]
    heads or data without boxes."""
    from swarm.zoo import describe_model, model_source
    from swarm.zoo.anchors import anchors_line, box_sizes, cfg_with_anchors, fitted_anchors

    _, text, source = model_source(cfg.model)
    desc = describe_model(cfg.model, cfg.img_size, cfg.classes, text)
    wh = box_sizes(train_set)
    if not len(wh):
        raise SwarmError(f"--anchors auto: {train_set.name} has no boxes to fit anchors to")
    anchors, before, after = fitted_anchors(desc, wh)
    log(f"anchors fitted to the {len(wh)} training boxes at {desc.img_size}: {anchors_line(anchors)} "
        f"(mean IoU of a box with its anchor {before:.3f} with the .cfg's, {after:.3f} fitted)")
    return cfg_with_anchors(text, source, desc, anchors)


class StepReporter:
    """What happens after every committed step: the progress line, the metrics file, and
    the periodic checkpoint."""

    def __init__(self, cfg: TrainConfig, progress: Progress, metrics_file, save_hook=None, save_every: int = 0,
                 save_every_s: float = 0.0):
        self.cfg = cfg
        self.progress = progress
        self.metrics_file = metrics_file
        self.save_hook = save_hook
        self.save_every = save_every  # steps between checkpoints (0: none by steps)
        self.save_every_s = save_every_s  # and seconds at the most between them (0: none by time)
        self.t_start = time.monotonic()
        self.last_save = self.t_start
        self.first_loss: float | None = None
        self.last_loss: float | None = None

    def __call__(self, step: int, loss: float, samples: int, seconds: float, extra: str = "",
                 fields: dict | None = None) -> None:
        """`step` is the number of finished steps; `seconds` the time of this one."""
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss
        self.progress.update(step, loss, samples, extra)
        if self.metrics_file:
            record = {"step": step, "loss": loss, "samples_per_s": samples / max(seconds, 1e-9),
                      "wall_s": time.monotonic() - self.t_start, "lr": self.cfg.lr_at(step - 1)}
            record.update(fields or {})
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        now = time.monotonic()
        due = (self.save_every and step % self.save_every == 0) or \
            (self.save_every_s and now - self.last_save >= self.save_every_s)
        if self.save_hook and due and step < self.progress.total:
            self.save_hook()
            self.last_save = now


def run_local_steps(trainer: "LocalTrainer", train_set, start: int, total: int, report: StepReporter) -> None:
    """Train `trainer` in this process from step `start` to `total`, loading the next batch
    while the current one trains."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarm-data")

    def fetch(step: int):
        return training_batch(trainer, train_set, step)

    try:
        pending = pool.submit(fetch, start) if start < total else None
        for step in range(start, total):
            images, targets = pending.result()
            pending = pool.submit(fetch, step + 1) if step + 1 < total else None
            t0 = time.monotonic()
            loss = trainer.step(images, targets)
            report(step + 1, loss, len(images), time.monotonic() - t0)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def train(cfg: TrainConfig, *, state: dict | None = None, save: str | None = None, metrics: str | None = None,
          threads: int | None = None, evaluate_at_end: bool = True, save_every: int = 0,
          save_every_s: float = 0.0, log=print,
          make_trainer=LocalTrainer, run_steps=run_local_steps) -> dict:
    """Train; returns a summary dict (steps, losses, metric, checkpoint path).

    `make_trainer(cfg, cfg_text, state)` builds the trainer (LocalTrainer, or one that runs
    each micro-batch another way, such as tiled); `run_steps(trainer, train_set, start,
    total, report)` runs the steps (in this process, or across the swarm) and leaves the
    trainer holding the weights of its last step."""
    from swarm.local.evaluate import evaluate

    n_threads = set_threads(threads)
    cfg_text = state.get("cfg") if state else None
    cfg, train_set, heldout = prepare(cfg, cfg_text)
    if state is None and cfg.anchors == "auto":
        cfg_text = fit_cfg_anchors(cfg, train_set, log)
    total_steps = resolve_steps(cfg, len(train_set))
    cfg.resolve_lr_drops(total_steps)
    trainer = make_trainer(cfg, cfg_text, state)
    check_classes(trainer.desc, cfg, train_set)
    skipped = getattr(train_set, "skipped", [])
    if skipped:
        shown = "\n  ".join(skipped[:5]) + (f"\n  ... and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        log(f"skipped {len(skipped)} unusable sample(s):\n  {shown}")
    desc = trainer.desc
    if trainer.started_from:
        log(trainer.started_from)
    log(f"model {desc.name}: {len(desc.layers)} layers, {desc.params / 1e6:.2f} M parameters, "
        f"{desc.img_size} input, {desc.flops / 1e9:.2f} GFLOPs forward per sample")
    log(f"data: {train_set.name}, {len(train_set)} images, {train_set.num_classes} classes; "
        f"batch {cfg.batch_size} in {cfg.microbatches} micro-batch(es); {n_threads} thread(s); seed {cfg.seed}; "
        f"augmentation: {trainer.augment.describe() if cfg.augment else 'off'}")
    start = trainer.step_count
    if start >= total_steps:
        log(f"the checkpoint is already at step {start} of {total_steps}; nothing to train")
    metrics_file = open(metrics, "a") if metrics else None  # noqa: SIM115 - closed in finally
    progress = Progress(total_steps, start)
    report = StepReporter(cfg, progress, metrics_file,
                          (lambda: save_checkpoint(save, trainer.state())) if save else None, save_every,
                          save_every_s)
    interrupted = False
    old_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if _main_thread() else None
    try:
        run_steps(trainer, train_set, start, total_steps, report)
    except KeyboardInterrupt:
        interrupted = True
        progress.message(f"interrupted after step {trainer.step_count}")
    finally:
        if metrics_file:
            metrics_file.close()
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
    summary = {"steps": trainer.step_count, "first_loss": report.first_loss, "last_loss": report.last_loss,
               "seconds": time.monotonic() - report.t_start, "checkpoint": None, "eval": None,
               "interrupted": interrupted}
    if save:
        save_checkpoint(save, trainer.state())
        summary["checkpoint"] = str(Path(save).resolve())
    if evaluate_at_end and not interrupted:
        try:  # a problem with the held-out data must not hide the model just saved
            summary["eval"] = evaluate(trainer.net, desc, heldout)
        except SwarmError as exc:
            summary["eval_error"] = str(exc)
    summary["trainer"] = trainer
    return summary


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
