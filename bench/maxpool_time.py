"""What the 2x2 max-pool in two halves (tiles.ops.maxpool_2x2) saves against torch's kernel on a
channels-last copy: each 2x2 max-pool of a network on its own, then whole training passes,
both ways alternating in one process on one thread, with glibc as swarm tunes it, medians.

    python bench/maxpool_time.py [--model yolov2-16 --img-size 416 --samples 4 --rounds 7]

Prints, per max-pool, the milliseconds of its forward each way; then the CPU seconds of a whole
pass (keeping every map, and remaking BatchNorm) each way and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.host import malloc  # noqa: E402

malloc.tune()

import torch  # noqa: E402

import tiles.ops as ops  # noqa: E402
from planner.memory import recomputable  # noqa: E402
from swarm.zoo import build_model, describe_model  # noqa: E402

TWO_HALVES = ops.maxpool_2x2


def channels_last(xp):
    return None  # maxpool_forward then takes the channels-last kernel


def timed(way, f, *args) -> float:
    ops.maxpool_2x2 = TWO_HALVES if way == "two halves" else channels_last
    start = time.process_time()
    f(*args)
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    ways = ("channels-last", "two halves")
    desc = describe_model(args.model, args.img_size)
    pools = [layer for layer in desc.layers if layer.kind == "maxpool" and layer.kernel == 2 and layer.stride == 2]
    print(f"{args.model} at {args.img_size}, {args.samples} samples, {args.rounds} rounds, one thread")
    for layer in pools:
        x = torch.randn(args.samples, *layer.in_shape)
        ms = {w: [] for w in ways}
        for _ in range(args.rounds):
            for w in ways:
                ms[w].append(1000 * timed(w, ops.maxpool_forward, x, 2, 2))
        print(f"  layer {layer.index} max-pool of {tuple(x.shape)}: " + ", ".join(
            f"{w} {statistics.median(ms[w]):.1f} ms" for w in ways))
    net, desc, _ = build_model(args.model, args.img_size, seed=1)
    net.train()
    x = torch.rand(args.samples, 3, args.img_size, args.img_size)

    def step():
        net(x).float().pow(2).mean().backward()

    for form, remade in (("keeping every map", frozenset()), ("remaking BatchNorm", recomputable(desc))):
        net.recompute = remade
        seconds = {w: [] for w in ways}
        for w in ways:
            timed(w, step)
        for _ in range(args.rounds):
            for w in ways:
                seconds[w].append(timed(w, step))
        ratio = statistics.median(b / a for a, b in zip(seconds[ways[0]], seconds[ways[1]]))
        print(f"  whole passes, {form}: " + ", ".join(f"{w} {statistics.median(seconds[w]):.3f} CPU s"
                                                    for w in ways) + f"; two halves / channels-last {ratio:.3f}")


if __name__ == "__main__":
    main()
