"""Plain PyTorch DDP training of a swarm zoo model: the baseline a user would write, started with torchrun.

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/peers/ddp.py --model yolov2-16 --img-size 416 \\
        --batch-size 8 --microbatches 8 --steps 4 --seed 1 --metrics ddp.jsonl

The same network, data, loss and optimizer as `swarm train` (its defaults: SGD, lr 0.001 with
20 steps of warm-up, momentum 0.9, weight decay 5e-4 on weights). Each step rank r of W takes
samples r::W of the step's global batch (so W need not divide the batch), splits its share into
up to --microbatches micro-batches and accumulates their gradients, all-reducing only on the
last (no_sync on the others). BatchNorm statistics are per rank and micro-batch, as plain DDP
has them. One compute thread per rank. Rank 0 appends one JSON line per step to --metrics:
step, seconds (loading its share, forward, backward, all-reduce, optimizer step), samples
(the global batch), samples_per_s, loss (the global batch's), rank_cpu_s (each rank's
CPU seconds in the step: how busy it was), rank_main_cpu_s (those of its main thread: the
compute, without gloo's threads) and ranks. With --checkpoint a worker starts from the
checkpoint when there is one, and rank 0 writes one every --save-every steps: what torchrun's
elastic agent restarts workers from after a lost node (bench/versus_kill.py).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from swarm.commands.flags import non_negative_int, positive_float, positive_int
from swarm.data import class_targets, make_batch, microbatch_bounds, sample_keys, step_indices
from swarm.errors import SwarmError
from swarm.local.trainer import DEFAULT_STEPS, TrainConfig, make_optimizer, prepare, set_lr
from swarm.zoo import build_model
from swarm.zoo.loss import make_loss


class Parser(argparse.ArgumentParser):
    """Mistakes in the flags: one line, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def training_flags(p: argparse.ArgumentParser, microbatches: str) -> None:
    """The flags a peer shares with `swarm train` (the model, data and optimizer), and --metrics and --save."""
    p.add_argument("--model", default="yolov2-16", help="a built-in model or a .cfg path (default: yolov2-16)")
    p.add_argument("--img-size", type=positive_int, help="input size (default: as swarm train)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="global samples per step (default: 16)")
    p.add_argument("--microbatches", type=positive_int, default=1, help=f"{microbatches} (default: 1)")
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, help=f"steps (default: {DEFAULT_STEPS})")
    p.add_argument("--seed", type=non_negative_int, default=0, help="initial weights and sample order (default: 0)")
    p.add_argument("--lr", type=positive_float, help="learning rate (default: 0.001)")
    p.add_argument("--warmup", type=non_negative_int, default=20, help="steps of lr warm-up (default: 20)")
    p.add_argument("--metrics", metavar="FILE", help="rank 0 appends one JSON object per step to FILE")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves the trained weights (a state dict) here")


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="ddp.py", description=__doc__.splitlines()[0])
    training_flags(p, "micro-batches per rank's share")
    p.add_argument("--checkpoint", metavar="PATH", help="resume from PATH when it exists; rank 0 writes it "
                   "(weights, optimizer, step; atomically) every --save-every steps: what a worker restarted by "
                   "torchrun's elastic agent (--max-restarts) carries on from")
    p.add_argument("--save-every", type=positive_int, default=1, help="steps between checkpoints (default: 1)")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size < world:
        p.error(f"--batch-size {args.batch_size} leaves some of the {world} ranks without samples")
    return args


def configure(args: argparse.Namespace):
    """(cfg, train set) as swarm train fills them in: the image size and classes of the model."""
    cfg = TrainConfig(model=args.model, img_size=args.img_size, batch_size=args.batch_size,
                      microbatches=args.microbatches, steps=args.steps, seed=args.seed, lr=args.lr,
                      warmup=args.warmup)
    cfg, train_set, _ = prepare(cfg)
    return cfg, train_set


def setup(cfg: TrainConfig):
    """(DDP model, loss function, optimizer) as swarm train builds them."""
    net, desc, _ = build_model(cfg.model, cfg.img_size, cfg.classes, cfg.seed)
    net.train()
    model = DistributedDataParallel(net)
    return model, make_loss(desc), make_optimizer(model.named_parameters(), cfg)


def targets_for_loss(detects: bool, targets) -> torch.Tensor:
    """Boxes for a detector's loss, the class of each image for a classifier."""
    if detects:
        return torch.from_numpy(targets)
    return torch.from_numpy(class_targets(targets))


def train_step(step: int, cfg: TrainConfig, train_set, model, loss_fn, optimizer) -> tuple[float, int]:
    """One optimizer step on this rank's share of the global batch; (its part of the
    global batch's loss, the global batch size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    indices = step_indices(len(train_set), cfg.batch_size, step, cfg.seed)
    images, targets = make_batch(train_set, indices[rank::world])
    targets = targets_for_loss(model.module.desc.detects, targets)
    keys = sample_keys(step, range(rank, len(indices), world))  # the same dropout masks as swarm's
    bounds = microbatch_bounds(len(images), min(cfg.microbatches, len(images)))
    part = 0.0
    for j, (lo, hi) in enumerate(bounds):
        last = j == len(bounds) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            out = model(torch.from_numpy(images[lo:hi]), keys[lo:hi])
            loss = loss_fn(out, targets[lo:hi], len(indices))  # this share's sum over the global batch size
            (loss * world).backward()  # DDP averages over ranks: times W, the sum over all ranks
        part += float(loss.detach())
    set_lr(optimizer, cfg.lr_at(step))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return part, len(indices)


def gather_step(part: float, cpu_s: float, main_s: float) -> tuple[float, list[float], list[float]]:
    """(the global batch's loss, each rank's CPU seconds, those of each rank's main thread)
    from every rank's own, in one all-reduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.zeros(1 + 2 * world, dtype=torch.float64)
    values[0], values[1 + rank], values[1 + world + rank] = part, cpu_s, main_s
    dist.all_reduce(values)
    return float(values[0]), values[1:1 + world].tolist(), values[1 + world:].tolist()


def resume(path: str | None, model, optimizer) -> int:
    """Load the checkpoint at `path` if there is one; the step it was written after (0: none)."""
    if not path or not os.path.exists(path):
        return 0
    state = torch.load(path, weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_checkpoint(path: str, model, optimizer, step: int) -> None:
    """Rank 0's checkpoint after `step` steps, written beside and renamed into place."""
    part = f"{path}.part"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, part)
    os.replace(part, path)


def train(args: argparse.Namespace, cfg: TrainConfig, train_set) -> None:
    model, loss_fn, optimizer = setup(cfg)
    start = resume(args.checkpoint, model, optimizer)
    metrics = open(args.metrics, "a") if args.metrics and dist.get_rank() == 0 else None  # noqa: SIM115
    try:
        for step in range(start, cfg.steps):
            t0, c0, m0 = time.monotonic(), time.process_time(), time.thread_time()
            part, samples = train_step(step, cfg, train_set, model, loss_fn, optimizer)
            seconds, cpu_s, main_s = time.monotonic() - t0, time.process_time() - c0, time.thread_time() - m0
            loss, rank_cpu_s, rank_main_cpu_s = gather_step(part, cpu_s, main_s)
            if metrics:
                metrics.write(json.dumps({"step": step + 1, "seconds": seconds, "samples": samples,
                                          "samples_per_s": samples / seconds, "loss": loss,
                                          "rank_cpu_s": rank_cpu_s,
                                          "rank_main_cpu_s": rank_main_cpu_s, "ranks": dist.get_world_size()}) + "\n")
                metrics.flush()
            if args.checkpoint and dist.get_rank() == 0 and (step + 1) % args.save_every == 0:
                save_checkpoint(args.checkpoint, model, optimizer, step + 1)
    finally:
        if metrics:
            metrics.close()
    if args.save and dist.get_rank() == 0:
        torch.save(model.module.state_dict(), args.save)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        cfg, train_set = configure(args)
    except SwarmError as exc:
        print(f"ddp.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    faulthandler.enable()  # should torch's C++ abort this rank, its stderr shows where in Python
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(args, cfg, train_set)
        dist.barrier()  # every rank done (rank 0's save included) before any tears its connections down
    finally:
        dist.destroy_process_group()
    leave()


def leave() -> None:
    """End a rank that has written and closed everything, without the interpreter's teardown.
    Tearing down with torch's C++ threads (gloo's, autograd's) still about has aborted a rank
    after a complete run ('terminate called without an active exception', SIGABRT), and
    torchrun then fails the whole run and restarts or stops the others."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
