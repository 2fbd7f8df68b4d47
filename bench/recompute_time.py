"""What remaking BatchNorm in the backward and checkpointed segments cost in time: whole training
passes keeping every map, remaking (swarm.zoo.recompute) and in checkpointed segments
(planner.checkpoint, Net.checkpoint), alternating in one process on one thread, medians.

    python bench/recompute_time.py [--models yolov2-16:416:2,yolov4-tiny:256:4,mobilenetv2:128:4 --rounds 5]
                                   [--as-swarm]

With --as-swarm the process runs on the allocator and settings a `swarm` command that trains
would (swarm.host.malloc: jemalloc where installed or fetched, else glibc without its tcache and with
swarm's heap settings; SWARM_MALLOC=glibc picks glibc where jemalloc is installed).

Each entry is model:size:samples. Prints, per model, the median CPU seconds of a pass each way
and their ratios to keeping.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from planner.memory import recomputable  # noqa: E402
from swarm.host import malloc  # noqa: E402
from swarm.zoo import build_model  # noqa: E402


def one_pass(net, x) -> None:
    out = net(x)
    out = out if isinstance(out, (list, tuple)) else [out]
    sum(o.float().pow(2).mean() for o in out).backward()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="yolov2-16:416:2,yolov4-tiny:256:4,mobilenetv2:128:4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--as-swarm", action="store_true", help="the allocator and settings swarm trains on")
    args = parser.parse_args()
    if args.as_swarm:
        malloc.preload(["train"])  # starts this script again on them, the first time
        malloc.tune()
        print(f"allocator: {malloc.allocator()}")
    torch.set_num_threads(1)
    print("model        size samples  keeping s  remaking s  ratio  segments s  ratio")
    for entry in args.models.split(","):
        name, size, samples = entry.split(":")
        net, desc, _ = build_model(name, int(size), classes=5, seed=1)
        net.train()
        every = recomputable(desc)
        x = torch.rand(int(samples), *desc.layers[0].in_shape)
        one_pass(net, x)  # kernels initialised
        times: dict[str, list[float]] = {"off": [], "on": [], "segments": []}
        for _ in range(args.rounds):
            for mode in times:
                net.recompute = every if mode == "on" else frozenset()
                net.checkpoint = mode == "segments"
                start = time.process_time()
                one_pass(net, x)
                times[mode].append(time.process_time() - start)
        off, on, ck = (statistics.median(times[mode]) for mode in ("off", "on", "segments"))
        print(f"{name:12} {size:>4} {samples:>7}  {off:9.3f}  {on:10.3f}  {on / off:5.3f}  {ck:10.3f}  {ck / off:5.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
