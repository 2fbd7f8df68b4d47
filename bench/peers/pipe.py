"""torch's own pipeline (torch.distributed.pipelining, 1F1B, gloo) of a swarm zoo model under torchrun.

One stage per rank (two here):

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/peers/pipe.py --model yolov2-16 --img-size 416 \\
        --batch-size 8 --microbatches 8 --steps 4 --seed 1 --metrics pipe.jsonl

What a user who reached for torch's own pipelining would write for a network too big for one
device: the layers cut into as many contiguous stages as there are ranks, about equal in
forward FLOPs (or where --split says), each stage a PipelineStage, and Schedule1F1B over the
step's micro-batches. The same network, data, loss and optimizer as `swarm train` and
bench/peers/ddp.py; BatchNorm over each micro-batch, as swarm has it, so the run trains what
swarm's local trainer trains. Rank 0 appends one JSON line per step to --metrics, with the
fields ddp.py writes (seconds, samples, samples_per_s, loss, rank_cpu_s, rank_main_cpu_s,
ranks) and the stages' first layers. The shapes that cross between stages are given to torch
rather than inferred: its inference runs each stage once, which would move BatchNorm's
running statistics a step ahead of what local training has.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from ddp import Parser, configure, gather_step, leave, targets_for_loss, training_flags  # bench/peers, beside this file
from swarm.data import make_batch, step_indices
from swarm.errors import SwarmError
from swarm.local.trainer import make_optimizer, set_lr
from swarm.zoo import build_model, describe_model
from swarm.zoo.loss import make_loss


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="pipe.py", description=__doc__.splitlines()[0])
    training_flags(p, "micro-batches per step, all of equal size")
    p.add_argument("--split", metavar="L1,L2,...", help="the first layer of each stage after the first "
                   "(default: stages of about equal forward FLOPs)")
    args = p.parse_args(argv)
    if args.batch_size % args.microbatches:
        p.error(f"--batch-size {args.batch_size} does not split into {args.microbatches} equal micro-batches, "
                f"which torch's pipeline schedules need")
    if args.split is not None:
        try:
            args.split = [int(x) for x in args.split.split(",")]
        except ValueError:
            p.error(f"--split takes layer numbers separated by commas, not {args.split!r}")
    return args


def even_split(flops: list[float], stages: int) -> list[int]:
    """The first layer of each stage when `flops` (per layer, in order) is cut into `stages`
    contiguous runs of at least one layer, the largest run as small as it can be."""
    n = len(flops)
    prefix = [0.0]
    for f in flops:
        prefix.append(prefix[-1] + f)
    # best[s][i]: the least largest run when layers [0, i) make s stages; cut[s][i]: where the last starts
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    firsts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        firsts.append(i)
    return firsts[::-1]


def stage_firsts(args: argparse.Namespace, desc, stages: int) -> list[int]:
    """The first layer of every stage, checked."""
    layers = len(desc.layers)
    if stages > layers:
        raise SwarmError(f"{stages} ranks for {layers} layers: every stage needs a layer")
    if args.split is None:
        return even_split([max(d.flops, 1) for d in desc.layers], stages)
    firsts = [0, *args.split]
    if stages == 1:
        raise SwarmError(f"--split {','.join(map(str, args.split))}: one rank runs the whole network as one stage "
                         f"(start one rank per stage)")
    if len(firsts) != stages or any(not a < b for a, b in zip(firsts, firsts[1:])) or firsts[-1] >= layers:
        raise SwarmError(f"--split {','.join(map(str, args.split))}: {stages} ranks make {stages} stages, so it "
                         f"takes {stages - 1} increasing layer numbers between 1 and {layers - 1}")
    return firsts


class StageModule(nn.Module):
    """Layers [first, last) of the network: takes the tensors that cross into the stage, in
    layer order (the image for the first), and gives those that cross out (the network's
    output for the last)."""

    def __init__(self, net, first: int, last: int):
        super().__init__()
        for i in range(len(net.layers)):
            if not first <= i < last:
                net.layers[i] = nn.Identity()  # another rank's layers: not kept
        self.net, self.first, self.last = net, first, last
        self.inputs = [-1] if first == 0 else sorted(net.desc.live_after(first))

    def forward(self, *tensors):
        out = self.net.forward_range(self.first, self.last, dict(zip(self.inputs, tensors)))
        values = tuple(out[k] for k in sorted(out))
        return values[0] if len(values) == 1 else values


def plan_stages(args: argparse.Namespace, cfg) -> list[int]:
    """The first layer of each rank's stage; SwarmError for a model or split this script cannot run."""
    desc = describe_model(cfg.model, cfg.img_size, cfg.classes)
    if any(d.kind == "dropout" for d in desc.layers):
        raise SwarmError(f"{cfg.model} has dropout, which this script does not draw as swarm does")
    return stage_firsts(args, desc, int(os.environ.get("WORLD_SIZE", "1")))


def setup(cfg, firsts: list[int]):
    """(this rank's PipelineStage's module, the schedule, the optimizer or None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net, desc, _ = build_model(cfg.model, cfg.img_size, cfg.classes, cfg.seed)
    ends = [*firsts[1:], len(desc.layers)]
    module = StageModule(net, firsts[rank], ends[rank])
    module.train()
    # The shapes that cross each stage boundary, given rather than inferred: torch infers them
    # by running the stage once, which moves BatchNorm's running statistics a step further.
    size = cfg.batch_size // cfg.microbatches

    def shapes(layers, dtype=torch.float32):
        made = tuple(torch.empty(size, *(desc.layers[0].in_shape if k == -1 else desc.layers[k].out_shape),
                                 device="meta", dtype=dtype, requires_grad=dtype.is_floating_point) for k in layers)
        return made[0] if len(made) == 1 else made

    outputs = [ends[rank] - 1] if rank == world - 1 else sorted(desc.live_after(ends[rank]))
    stage = PipelineStage(module, rank, world, torch.device("cpu"),
                          input_args=shapes(module.inputs, torch.uint8 if rank == 0 else torch.float32),
                          output_args=shapes(outputs))
    loss = make_loss(desc)
    schedule = Schedule1F1B(stage, cfg.microbatches, loss_fn=lambda out, target: loss(out, target, cfg.batch_size),
                            scale_grads=False)  # each micro-batch's loss is its sum over the whole batch already
    params = [(name, p) for name, p in module.named_parameters()]
    optimizer = make_optimizer(params, cfg) if params else None
    return module, schedule, optimizer


def train_step(step: int, cfg, train_set, module, schedule, optimizer) -> float:
    """One optimizer step of this rank's stage; its part of the batch's loss (the last stage's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    images, targets = make_batch(train_set, step_indices(len(train_set), cfg.batch_size, step, cfg.seed))
    targets = targets_for_loss(module.net.desc.detects, targets)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(torch.from_numpy(images), target=targets if world == 1 else None, losses=losses)
    elif rank == world - 1:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    if optimizer is not None:
        set_lr(optimizer, cfg.lr_at(step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(sum(float(x.detach()) for x in losses))


def save(path: str, module) -> None:
    """Every rank writes its stage's weights beside `path`; rank 0 merges them into `path`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    own = {k.removeprefix("net."): v for k, v in module.state_dict().items()}  # (the other layers are gone)
    torch.save(own, f"{path}.stage{rank}")
    dist.barrier()
    if rank == 0:
        merged = {}
        for r in range(world):
            merged.update(torch.load(f"{path}.stage{r}", weights_only=True))
            os.unlink(f"{path}.stage{r}")
        torch.save(merged, f"{path}.part")
        os.replace(f"{path}.part", path)


def train(args: argparse.Namespace, cfg, train_set, firsts: list[int]) -> None:
    module, schedule, optimizer = setup(cfg, firsts)
    metrics = open(args.metrics, "a") if args.metrics and dist.get_rank() == 0 else None  # noqa: SIM115
    try:
        for step in range(cfg.steps):
            t0, c0, m0 = time.monotonic(), time.process_time(), time.thread_time()
            part = train_step(step, cfg, train_set, module, schedule, optimizer)
            seconds, cpu_s, main_s = time.monotonic() - t0, time.process_time() - c0, time.thread_time() - m0
            loss, rank_cpu_s, rank_main_cpu_s = gather_step(part, cpu_s, main_s)
            if metrics:
                metrics.write(json.dumps({"step": step + 1, "seconds": seconds, "samples": cfg.batch_size,
                                          "samples_per_s": cfg.batch_size / seconds, "loss": loss,
                                          "rank_cpu_s": rank_cpu_s, "rank_main_cpu_s": rank_main_cpu_s,
                                          "ranks": dist.get_world_size(), "stage_firsts": firsts}) + "\n")
                metrics.flush()
    finally:
        if metrics:
            metrics.close()
    if args.save:
        save(args.save, module)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        cfg, train_set = configure(args)
        firsts = plan_stages(args, cfg)
    except SwarmError as exc:
        print(f"pipe.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train(args, cfg, train_set, firsts)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()


if __name__ == "__main__":
    main()
