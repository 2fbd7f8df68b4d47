"""How long planning takes: yolov2 (31 layers) over 8 heterogeneous devices, and a 200-layer
network over 16 devices — every planner, best of `--repeats` runs.

    python bench/planner_speed.py [--repeats 3] [--only asteroid,auto]

Targets: yolov2 x 8 devices within 1 s, 200 layers x 16 devices within 10 s. Devices are
analytical (GFLOP/s, memory bandwidth, memory) in four kinds, on a 100 Mbit/s network;
the 200-layer network is a plain stack of 3x3 conv + BatchNorm layers with a pooling
every 40 layers (a .cfg written below), at 128x128.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = [(5, "1 GiB"), (10, "2 GiB"), (20, "4 GiB"), (8, "1 GiB")]  # GFLOP/s, memory


def deep_cfg(layers: int = 200, img: int = 128) -> str:
    parts = [f"[net]\nwidth={img}\nheight={img}\nchannels=3\n"]
    ch = 16
    for n in range(layers - 2):
        if n % 40 == 39:
            parts.append("[maxpool]\nsize=2\nstride=2\n")
            ch = min(ch * 2, 256)
        else:
            parts.append(f"[convolutional]\nbatch_normalize=1\nfilters={ch}\nsize=3\nstride=1\npad=1\nactivation=leaky\n")
    parts += ["[avgpool]\n", "[connected]\noutput=10\nactivation=linear\n", "[softmax]\n"]
    return "\n".join(parts)


def scenario(name: str):
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel
    from planner.synthetic import flops_cluster
    from swarm.zoo import describe_model

    if name == "yolov2x8":
        desc, n = describe_model("yolov2", 416), 8
    else:
        desc, n = describe_model("deep200", cfg_text=deep_cfg()), 16
    devices = {f"d{i}": KINDS[i % len(KINDS)] for i in range(n)}
    cluster = flops_cluster(desc, devices, mbps=100, latency_ms=0.5, data_source="d0", mem_gbps=5)
    return desc, PlanInputs(desc, MemoryModel.estimated(desc), cluster, 32, 4)


def main() -> None:
    from planner.planners import STRATEGIES, make_plan
    from planner.report import table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(STRATEGIES))
    args = p.parse_args()
    targets = {"yolov2x8": 1.0, "deep200x16": 10.0}
    rows = []
    for name, target in targets.items():
        desc, inputs = scenario(name)
        for strategy in args.only.split(","):
            best, plan = float("inf"), None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = make_plan(strategy, inputs)
                best = min(best, time.perf_counter() - t0)
            verdict = "ok" if best <= target else "OVER"
            rows.append([name, f"{len(desc.layers)} layers x {len(inputs.cluster.devices)} devices", strategy,
                         f"{best:.3f}", f"{target:g}", verdict, f"{plan.predicted['step_time_s']:.2f}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"best of {args.repeats}; load average {load:.2f} on {os.cpu_count()} CPUs")
    print(table(rows, ["scenario", "size", "strategy", "planning s", "target s", "", "predicted step s"]))


if __name__ == "__main__":
    main()
