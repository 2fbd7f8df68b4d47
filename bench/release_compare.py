"""Training throughput of this tree against another checkout of swarm (an earlier release), on
the namespace testbed, alternating, medians (root).

    git worktree add /tmp/before <commit>
    sudo python bench/release_compare.py --baseline /tmp/before [--devices 4] [--cpu 0.25]
                                         [--bandwidth 100mbit] [--modes dp,tiles] [--reps 3] [--steps 4]

Each repetition runs every mode once on each tree, the trees in turn (the order swaps every
repetition, so neither gains from the machine's drift), each run on a freshly started testbed
whose agents run that tree's code:

    swarm train --model yolov2-16 --img-size 416 --batch-size 8 --microbatches 8 --steps 4
                --strategy MODE --devices N --metrics FILE --no-eval

A run's figure is the median samples/s over its steps after the first (see swarm_bench.py).
Reported per mode: each tree's runs, their medians, and this tree's median over the baseline's.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load_swarm_bench():
    spec = importlib.util.spec_from_file_location("swarm_bench", HERE / "swarm_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="a checkout of the swarm to compare against")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--cpu", default="0.25")
    p.add_argument("--mem", default="1G")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--modes", default="dp,tiles")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    baseline = Path(args.baseline).resolve()
    if not (baseline / "swarm" / "__init__.py").exists():
        sys.exit(f"{baseline} is not a checkout of swarm (no swarm/__init__.py)")
    bench = load_swarm_bench()
    bench.TESTBED[:] = ["--devices", args.devices, "--cpu", args.cpu, "--mem", args.mem,
                        "--bandwidth", args.bandwidth]
    common = ["--model", "yolov2-16", "--img-size", args.img_size, "--batch-size", args.batch_size,
              "--microbatches", args.microbatches, "--steps", args.steps, "--seed", 1, "--devices", args.devices]
    trees = {"baseline": baseline, "this": ROOT}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rates: dict[tuple[str, str], list[float]] = {(t, m): [] for t in trees for m in modes}
    print(f"testbed: {args.devices} devices, {args.cpu} core, {args.mem}, {args.bandwidth} each; yolov2-16 at "
          f"{args.img_size}, batch {args.batch_size} in {args.microbatches} micro-batches; baseline {baseline}",
          flush=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
                for tree in order:
                    bench.ENV["PYTHONPATH"] = str(trees[tree])  # the agents and the coordinator run this code
                    for mode in modes:
                        r = bench.measure(f"{tree} {mode} {rep}", [*common, "--strategy", mode],
                                          args.devices, Path(tmp))
                        if "error" in r or r["used"] != args.devices:
                            print(f"  rep {rep} {tree:<8} {mode:<6} failed: {r.get('error', 'fewer devices')}",
                                  flush=True)
                            continue
                        rates[tree, mode].append(r["samples_per_s"])
                        print(f"  rep {rep} {tree:<8} {mode:<6} {r['samples_per_s']:.3f} samples/s "
                              f"(steps {', '.join(f'{x:.3f}' for x in r['rates'])})", flush=True)
    finally:
        bench.swarm("testbed", "down", check=False)
    summary = {}
    for mode in modes:
        base, this = rates["baseline", mode], rates["this", mode]
        if not base or not this:
            print(f"{mode}: not enough runs to compare")
            continue
        ratio = statistics.median(this) / statistics.median(base)
        summary[mode] = {"baseline": base, "this": this, "ratio": ratio}
        print(f"{mode}: baseline median {statistics.median(base):.3f}, this {statistics.median(this):.3f} "
              f"samples/s; this / baseline = {ratio:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
