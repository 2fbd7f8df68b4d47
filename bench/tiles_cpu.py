"""CPU time of one training pass (forward + backward) of yolov2-16 through the tiles executor, by grid.

    python bench/tiles_cpu.py [--img-size 416] [--batch 8] [--grids 1x1,2x2,2x4] [--repeats 2]

All tiles run one after another in this process on one thread, the batch as one block of
single-sample micro-batches (each with its own BatchNorm statistics), against the untiled
network under autograd on the same batch. Prints process CPU seconds per pass (the last of
--repeats; the first warms up): the work the tiles of a grid add or save in total, before any
network is involved.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--grids", default="1x1,2x2,2x4")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    import torch

    from swarm import malloc
    from swarm.zoo import build_model
    from tiles.grouping import Grouping, parse_grid
    from tiles.stage import InProcessStage

    malloc.tune()  # as every swarm process does
    torch.set_num_threads(1)
    net, desc, _ = build_model("yolov2-16", args.img_size, classes=5, seed=1)
    net.train()
    n = len(desc.layers)
    x = torch.rand(args.batch, 3, args.img_size, args.img_size)
    dy = torch.randn(args.batch, *desc.layers[n - 1].out_shape)

    def timed(fn) -> float:
        for _ in range(args.repeats):
            t = time.process_time()
            fn()
        return time.process_time() - t

    def untiled():
        y = x
        for layer in net.layers:
            y = layer(y)
        (y * dy).sum().backward()

    print(f"yolov2-16 at {args.img_size}, batch {args.batch}, one thread: CPU seconds per forward + backward")
    base = timed(untiled)
    print(f"{'untiled (autograd)':<20} {base:7.2f}")
    for text in args.grids.split(","):
        grid = parse_grid(text)
        stage = InProcessStage.build(net.layers, desc.layers, grid, Grouping.every_layer(0, n), False)
        cpu = timed(lambda: (stage.forward(0, x, (1,) * args.batch), stage.backward(0, dy)))
        print(f"{'tiles ' + text:<20} {cpu:7.2f}  ({cpu / base:.2f}x untiled)")


if __name__ == "__main__":
    main()
