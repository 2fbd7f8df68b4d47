"""Tiling's costs on one thread for yolov2-16 (default 416x416): compute of all tiles vs untiled, and memory per tile.

    python bench/tiles_bench.py [--img-size 416] [--batch 1] [--repeats 3]
                                [--grids 2x2,4x4] [--syncs all,0,4,8,12,none] [--memory-grids 1x2,2x2,3x3,4x4]
                                [--skip-time] [--skip-memory]

Time. One process, one thread. Each round runs, in turn, the untiled stage (the zoo's
modules under autograd) and every (grid, grouping): all tiles one after another in this
process (tiles.whole_stage.InProcessStage), forward + backward of one micro-batch, so the time
is the total compute of all tiles (the lockstep driver adds only Python bookkeeping). The
ratio tiled / untiled is taken within each round and the median over rounds is printed,
so drift in a machine shared with other work cancels out. The cost model's ratio of
FLOPs (all tiles / untiled) is printed beside it.

Memory. Each configuration runs in a fresh process (bench/tiles_memory.py explains the
measurement): the peak physical memory one tile needs when it runs alone, as a device
holding that tile would, vs the untiled stage; weights and gradients excluded in both.
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
sys.path.insert(0, str(ROOT))

MIB = 2 ** 20


def parse_grid(text: str) -> tuple[int, int]:
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


def time_configs(img_size: int, batch: int, grids: list[str], syncs: list[str], repeats: int) -> None:
    import torch

    from swarm.zoo import build_model
    from tiles.cost import stage_cost
    from tiles.grouping import Grouping
    from tiles.whole_stage import InProcessStage

    torch.set_num_threads(1)
    net, desc, _ = build_model("yolov2-16", img_size, classes=20, seed=0)
    net.train()
    n = len(desc.layers)
    x = torch.rand(batch, 3, img_size, img_size)
    dy = torch.randn(batch, *desc.layers[-1].out_shape)

    def untiled() -> float:
        t0 = time.perf_counter()
        net(x).backward(dy)
        return time.perf_counter() - t0

    stages = {}
    for grid in grids:
        for sync in syncs:
            stages[(grid, sync)] = InProcessStage.build(net.layers, desc.layers, parse_grid(grid),
                                                        Grouping.parse(sync, 0, n), input_delta=False)

    def tiled(stage) -> float:
        t0 = time.perf_counter()
        stage.forward(0, x)
        stage.backward(0, dy)
        return time.perf_counter() - t0

    untiled()  # warm-up
    for stage in stages.values():
        tiled(stage)
    base_times, ratios = [], {key: [] for key in stages}
    for _ in range(repeats):
        base = untiled()
        base_times.append(base)
        for key, stage in stages.items():
            ratios[key].append(tiled(stage) / base)
    print(f"\ncompute time, yolov2-16 at {img_size}, batch {batch}, 1 thread, median of {repeats} rounds")
    print(f"  untiled forward+backward: {statistics.median(base_times):.3f} s")
    print(f"  {'grid':>5} {'sync':<12} {'all tiles / untiled':>20} {'model FLOPs ratio':>18}")
    for (grid, sync), rs in ratios.items():
        cost = stage_cost(stages[(grid, sync)].layout)
        print(f"  {grid:>5} {sync:<12} {statistics.median(rs):>19.2f}x {cost.total_flops / cost.untiled_flops:>17.2f}x"
              f"   (rounds: {', '.join(f'{r:.2f}' for r in rs)})")


def measure(args: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tiles_memory.py"), *args], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_configs(img_size: int, batch: int, grids: list[str], syncs: list[str]) -> None:
    common = ["--img-size", str(img_size), "--batch", str(batch)]
    base = measure(common + ["--grid", "untiled"])
    print(f"\npeak activation memory, yolov2-16 at {img_size}, batch {batch} (physical, weights and grads excluded)")
    print(f"  untiled (autograd): peak {base['peak_bytes'] / MIB:.1f} MiB, saved for backward "
          f"{base['saved_bytes'] / MIB:.1f} MiB")
    print(f"  {'grid':>5} {'sync':<12} {'largest tile':>13} {'/ untiled':>10} {'mean tile':>10} {'kept for bwd':>13}"
          f" {'model peak':>11}")
    for grid in grids:
        for sync in syncs:
            m = measure(common + ["--grid", grid, "--sync", sync])
            worst = max(m["peak_bytes"])
            print(f"  {grid:>5} {sync:<12} {worst / MIB:>9.1f} MiB {worst / base['peak_bytes']:>9.3f}x "
                  f"{statistics.mean(m['peak_bytes']) / MIB:>6.1f} MiB {max(m['saved_bytes']) / MIB:>9.1f} MiB "
                  f"{max(m['model_peak_bytes']) / MIB:>7.1f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--grids", default="2x2,4x4")
    p.add_argument("--syncs", default="all;0,4,8,12;none", help="groupings separated by ';'")
    p.add_argument("--memory-grids", default="1x1,1x2,2x2,3x3,4x4")
    p.add_argument("--memory-syncs", default="all", help="groupings separated by ';'")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args()
    if not args.skip_time:
        time_configs(args.img_size, args.batch, args.grids.split(","), args.syncs.split(";"), args.repeats)
    if not args.skip_memory:
        memory_configs(args.img_size, args.batch, args.memory_grids.split(","), args.memory_syncs.split(";"))


if __name__ == "__main__":
    main()
