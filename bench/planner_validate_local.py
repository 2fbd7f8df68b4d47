"""Predicted vs measured: the simulator's step time and peak memory for `local` plans against
the real local trainer on this machine.

    python bench/planner_validate_local.py [--model yolov2-16] [--sizes 128,224] [--configs 8x1,16x1,16x4]
                                           [--threads 1] [--clock wall|cpu] [--steps 4] [--rounds 3]
                                           [--state-dir DIR]

For each image size the profiler measures this machine (or reuses its cache) at batch sizes
covering every micro-batch. For each batch x micro-batches, a fresh process builds the
real LocalTrainer, runs one warm-up step, then times `--steps` optimizer steps on the
built-in data (median) while sampling its resident memory, `--rounds` times interleaved
(median of those); the plan `local` is simulated
from the profile alone. Memory is counted above the idle process (torch initialised,
without the model's weights and optimizer state), as the profiler counts it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(args) -> None:
    import torch

    from swarm.data import make_batch, open_datasets, step_indices
    from swarm.local.trainer import LocalTrainer, TrainConfig
    from swarm.profiling.profiler import OPTIMIZER_COPIES, _PeakRSS, settled_rss

    torch.set_num_threads(args.threads)
    data, _ = open_datasets(None, args.img, 3)
    cfg = TrainConfig(model=args.model, img_size=args.img, batch_size=args.batch, microbatches=args.micro, seed=0,
                      classes=data.num_classes)
    trainer = LocalTrainer(cfg)
    batches = [make_batch(data, step_indices(len(data), args.batch, s, 0)) for s in range(args.steps + 1)]
    trainer.step(*batches[0])  # warm-up: torch initialised, momentum buffers made
    resident = sum(OPTIMIZER_COPIES["sgd"] * p.numel() * p.element_size() for p in trainer.net.parameters())
    runtime = settled_rss() - resident
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    times = []
    with _PeakRSS() as rss:
        for images, targets in batches[1:]:
            t0 = now()
            trainer.step(images, targets)
            times.append(now() - t0)
    print(json.dumps({"step_s": statistics.median(times), "all_s": times, "peak": rss.peak - runtime}))


def measure(args, img: int, batch: int, micro: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--img", str(img), "--batch", str(batch),
           "--micro", str(micro), "--threads", str(args.threads), "--steps", str(args.steps), "--clock", args.clock]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--sizes", default="128,224")
    p.add_argument("--configs", default="8x1,16x1,16x4", help="batch x micro-batches, comma separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: count the compute thread's CPU time in the profile and the steps alike (one thread; "
                        "for a machine shared with other work)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per configuration, interleaved")
    p.add_argument("--repeats", type=int, default=5, help="profiler repeats")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--child", action="store_true")
    p.add_argument("--img", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--micro", type=int)
    args = p.parse_args()
    if args.child:
        child(args)
        return

    import numpy as np

    from planner.cluster import Cluster, Device
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel
    from planner.plan import Plan, Stage
    from planner.report import table
    from planner.units import format_bytes
    from swarm.profiling.profiler import load_or_profile
    from swarm.zoo import describe_model

    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    micro_sizes = sorted({b // m for b, m in configs})
    sizes = sorted({1, 2, 4} | set(micro_sizes))
    rows, errors = [], []
    for img in (int(s) for s in args.sizes.split(",")):
        profile, cached, path = load_or_profile(args.model, img, None, args.state_dir, batch_sizes=sizes,
                                                repeats=args.repeats, threads=args.threads, clock=args.clock,
                                                log=lambda t: print(f"  profiling {img}: {t}", file=sys.stderr))
        print(f"profile ({'cached' if cached else 'new'}): {path}", file=sys.stderr)
        desc = describe_model(args.model, img, profile.classes)
        mem = MemoryModel(desc, profile.act_bytes, measured=True)
        cluster = Cluster([Device("this", profile.costs, float("inf"))], np.full((1, 1), np.inf), 0.0, None)
        runs = {c: [] for c in configs}
        for _ in range(args.rounds):  # interleaved, so that a busy moment spreads over all configurations
            for batch, micro in configs:
                runs[(batch, micro)].append(measure(args, img, batch, micro))
        for batch, micro in configs:
            inputs = PlanInputs(desc, mem, cluster, batch, micro)
            plan = Plan(desc.name, img, batch, micro, [Stage(0, len(desc.layers), "single", ["this"])],
                        devices={"this": {}}, planner="local")
            timeline = inputs.simulate(plan)
            got = {"step_s": statistics.median(r["step_s"] for r in runs[(batch, micro)]),
                   "peak": statistics.median(r["peak"] for r in runs[(batch, micro)])}
            dt = timeline.step_time / got["step_s"] - 1
            dm = timeline.peak_memory["this"] / got["peak"] - 1
            errors.append(dt)
            rows.append([str(img), f"{batch} in {micro}", f"{timeline.step_time:.3f}", f"{got['step_s']:.3f}",
                         f"{100 * dt:+.1f}%", format_bytes(timeline.peak_memory["this"]), format_bytes(got["peak"]),
                         f"{100 * dm:+.1f}%"])
            print(" | ".join(rows[-1]), file=sys.stderr)
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.model}, {args.threads} thread(s), {args.clock} clock; measured: median over {args.rounds} processes "
          f"of the median of {args.steps} steps after a warm-up; load average at the end {load:.2f}")
    print(table(rows, ["img", "batch", "predicted s", "measured s", "error", "predicted peak", "measured peak",
                       "error"]))
    print(f"largest step-time error {100 * max(abs(e) for e in errors):.1f}%")


if __name__ == "__main__":
    main()
