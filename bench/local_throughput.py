"""Local training throughput and peak memory of a model (default yolov2-16 at 416x416).

    python bench/local_throughput.py [--model yolov2-16] [--img-size 416] [--batch-size 8]
                                     [--threads 1,2] [--steps 3] [--repeats 3]

Each (threads) configuration runs in a fresh process: one warm-up step, then `--steps`
timed optimizer steps of the real local trainer (SGD, real data), repeated `--repeats`
times; the median samples/s is printed with the peak resident memory of that process
and how much of it training added above the process after building the model.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(args) -> None:
    import resource

    import torch

    sys.path.insert(0, str(ROOT))
    from swarm.data import make_batch, open_datasets, step_indices
    from swarm.host import malloc
    from swarm.local.trainer import LocalTrainer, TrainConfig

    malloc.tune()  # as `swarm train` does
    torch.set_num_threads(args.threads_one)
    cfg = TrainConfig(model=args.model, img_size=args.img_size, batch_size=args.batch_size, seed=0)
    train_set, _ = open_datasets(None, args.img_size, 3)
    cfg.classes = train_set.num_classes
    trainer = LocalTrainer(cfg)
    batches = [make_batch(train_set, step_indices(len(train_set), cfg.batch_size, s, 0)) for s in range(args.steps + 1)]
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer.step(*batches[0])  # warm-up
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for images, targets in batches[1:]:
            trainer.step(images, targets)
        rates.append(args.steps * args.batch_size / (time.perf_counter() - t0))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rates": rates, "peak_mib": peak_kib / 1024, "base_mib": base_kib / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads-one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads_one:
        child(args)
        return
    print(f"{args.model} at {args.img_size}x{args.img_size}, batch {args.batch_size}, "
          f"{args.steps} steps x {args.repeats} repeats per configuration")
    print(f"{'threads':>7}  {'samples/s (median)':>18}  {'s/sample':>8}  {'peak RSS MiB':>12}  {'added by training MiB':>21}")
    for threads in [int(t) for t in args.threads.split(",")]:
        cmd = [sys.executable, __file__, "--model", args.model, "--img-size", str(args.img_size),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--repeats", str(args.repeats),
               "--threads-one", str(threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if out.returncode:
            sys.exit(out.stderr)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rate = statistics.median(r["rates"])
        print(f"{threads:>7}  {rate:>18.3f}  {1 / rate:>8.3f}  {r['peak_mib']:>12.0f}  {r['peak_mib'] - r['base_mib']:>21.0f}")


if __name__ == "__main__":
    main()
