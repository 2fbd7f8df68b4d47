"""What back-propagating BatchNorm a run of channels at a time (swarm.zoo.recompute) costs in time
and saves in memory: whole training passes of one network keeping every map, remaking BatchNorm
with the large maps streamed (as swarm runs it), and remaking with every map whole, alternating
in one process on one thread, medians.

    python bench/stream_time.py [--model yolov2-16 --img-size 416 --samples 4 --rounds 5]

Prints, per way, the median CPU seconds of a pass and its ratio to keeping every map.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from planner.memory import recomputable, streamed  # noqa: E402
from swarm.zoo import build_model, recompute  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    net, desc, _ = build_model(args.model, args.img_size, seed=1)
    net.train()
    x = torch.rand(args.samples, 3, args.img_size, args.img_size)
    stream_from = recompute.STREAM_FROM
    ways = {"keep": (frozenset(), stream_from), "remake, streamed": (recomputable(desc), stream_from),
            "remake, whole": (recomputable(desc), 1 << 62)}

    def one(way: str) -> float:
        net.recompute, recompute.STREAM_FROM = ways[way]
        start = time.process_time()
        net(x).float().pow(2).mean().backward()
        return time.process_time() - start

    seconds: dict[str, list[float]] = {w: [] for w in ways}
    for w in ways:
        one(w)
    for _ in range(args.rounds):
        for w in ways:
            seconds[w].append(one(w))
    print(f"{args.model} at {args.img_size}, {args.samples} samples a pass, {args.rounds} rounds; streamed layers: "
          f"{sorted(streamed(desc, recomputable(desc)))}")
    keep = statistics.median(seconds["keep"])
    for w, s in seconds.items():
        print(f"  {w:18s} {statistics.median(s):6.2f} CPU s a pass  {statistics.median(s) / keep:.3f}x keeping")


if __name__ == "__main__":
    main()
