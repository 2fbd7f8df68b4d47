"""What group BatchNorm costs a sample's compute against native BatchNorm, in one process.

    PYTHONPATH=. python bench/group_bn_cost.py [--model yolov2-16] [--img-size 416] [--reps 5]

A dp group's devices replace every BatchNorm with swarm.execution.group_bn.GroupBatchNorm,
which gathers the group's statistics at each BN layer; the profiles the planner costs plans
with are measured on the native model. This runs a training step (forward and backward of
one sample, one thread) of the model as built and with group BatchNorm whose exchange
returns this replica's own sums (a group of one: no network), alternating, and prints the
median thread CPU time of each and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def step_cpu(model: str, img_size: int, group: bool, reps: int) -> list[float]:
    import torch

    from swarm.execution.group_bn import replace_batchnorm
    from swarm.zoo import build_model

    net, _, _ = build_model(model, img_size, None, seed=0)
    net.train()
    if group:
        for _, bn in replace_batchnorm(net):
            bn.exchange = lambda tag, tensors: [tensors]
    x = torch.randn(1, 3, img_size, img_size)
    times = []
    for _ in range(reps + 1):  # the first warms up
        start = time.thread_time()
        net(x, [0]).float().sum().backward()
        times.append(time.thread_time() - start)
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    native, group = [], []
    for _ in range(args.rounds):
        native += step_cpu(args.model, args.img_size, False, args.reps)
        group += step_cpu(args.model, args.img_size, True, args.reps)
    n, g = statistics.median(native), statistics.median(group)
    print(f"{args.model} at {args.img_size}, one sample, one thread: native BatchNorm {n:.3f} CPU-s a step, "
          f"group BatchNorm {g:.3f}: {g / n:.3f}x")


if __name__ == "__main__":
    main()
