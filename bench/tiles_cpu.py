"""CPU time of one training step's passes of yolov2-16 through the tiles executor, by grid, against one device.

    python bench/tiles_cpu.py [--img-size 416] [--batch 8] [--grids 1x1,2x2,2x4] [--repeats 5]

One device is what a one-stage plan runs: the batch as single-sample micro-batches, one after
another, through the untiled network under autograd. Each grid runs the batch as one block of
single-sample micro-batches (each with its own BatchNorm statistics), all its tiles one after
another in this process. Everything on one thread; the two alternate, --repeats times after a
warm-up pass each, and the medians are printed: process CPU seconds per step, the grid's total
relative to one device, and its share per device when each tile has a device of its own.

The last column, one device's CPU over a tile's share, is the most a tiles plan over that many
devices can gain on devices whose CPU is the limit, before any network is involved: halos,
BatchNorm sums and the gradient sum only take from it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--grids", default="1x1,2x2,2x4")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import torch

    from swarm.host import malloc
    from swarm.zoo import build_model
    from tiles.grouping import Grouping, parse_grid
    from tiles.whole_stage import InProcessStage

    malloc.tune()  # as every swarm process does
    torch.set_num_threads(1)
    net, desc, _ = build_model("yolov2-16", args.img_size, classes=5, seed=1)
    net.train()
    n = len(desc.layers)
    x = torch.rand(args.batch, 3, args.img_size, args.img_size)
    dy = torch.randn(args.batch, *desc.layers[n - 1].out_shape)

    def one_device():
        for i in range(args.batch):
            y = x[i:i + 1]
            for layer in net.layers:
                y = layer(y)
            (y * dy[i:i + 1]).sum().backward()

    passes = {"one device": one_device}
    tiles = {}
    for text in args.grids.split(","):
        grid = parse_grid(text)
        stage = InProcessStage.build(net.layers, desc.layers, grid, Grouping.every_layer(0, n), False)
        passes[f"tiles {text}"] = lambda stage=stage: (stage.forward(0, x, (1,) * args.batch), stage.backward(0, dy))
        tiles[f"tiles {text}"] = grid[0] * grid[1]
    for run in passes.values():
        run()
    cpu: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(args.repeats):
        for name, run in passes.items():
            t = time.process_time()
            run()
            cpu[name].append(time.process_time() - t)
    one = statistics.median(cpu["one device"])
    print(f"yolov2-16 at {args.img_size}, batch {args.batch} in single-sample micro-batches, one thread: "
          f"CPU seconds per step (median of {args.repeats})")
    print(f"{'':<12} {'CPU s':>7} {'vs one':>7} {'per device':>11} {'most speedup':>13}")
    print(f"{'one device':<12} {one:7.2f} {1:7.2f}")
    for name, count in tiles.items():
        total = statistics.median(cpu[name])
        print(f"{name:<12} {total:7.2f} {total / one:7.3f} {total / count:11.2f} "
              f"{one / (total / count):9.2f} on {count}")


if __name__ == "__main__":
    main()
