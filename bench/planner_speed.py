"""How long planning takes, and whether faster planning still finds as good a plan.

    python bench/planner_speed.py [--repeats 3] [--only asteroid,auto]
    python bench/planner_speed.py --classroom [--sizes 8,16,32,64,128] [--repeats 3] [--only auto]
    python bench/planner_speed.py --classroom --record FILE      # write this planner's figures
    python bench/planner_speed.py --write-clusters               # examples/classroom-{16,32,64}-cluster.json

Two small scenarios, every planner, best of `--repeats` runs: yolov2 (31 layers) over 8
heterogeneous devices within 1 s, and a 200-layer network over 16 devices within 10 s. Their
devices are analytical (GFLOP/s, memory bandwidth, memory) in four kinds, on a 100 Mbit/s
network; the 200-layer network is a plain stack of 3x3 conv + BatchNorm layers with a
pooling every 40 layers (a .cfg written below), at 128x128.

The classroom (`--classroom`): N = 8, 16, 32, 64, 128 Raspberry-Pi-4-class devices of five
kinds on one gigabit switch (940 Mbit/s, 0.3 ms a message), yolov2-16 at 416, batch 64 in 8
micro-batches, planned as `swarm plan --model yolov2-16 --img-size 416 --devices
examples/classroom-N-cluster.json --batch-size 64 --microbatches 8 --compare` plans it (the
same memory model, glibc). The kinds, dealt round-robin, are assumptions in the manner of
examples/pi-jetson-cluster.json (a Pi 4's four A72 cores sustaining about 5 GFLOP/s of
float32 conv training, 4 GB/s of memory; budgets are the RAM less the OS, the runtime and a
job's reserve):

    pi4-1g  Pi 4 Model B 1 GB, an early board at 1.5 GHz               4.8 GFLOP/s   450 MiB
    pi4-2g  Pi 4 Model B 2 GB at 1.5 GHz                               5.0 GFLOP/s   1.3 GiB
    pi4-4g  Pi 4 Model B 4 GB at 1.5 GHz                               5.0 GFLOP/s   3 GiB
    pi4-8g  Pi 4 Model B 8 GB, a later board (1.8 GHz firmware, warmer) 5.2 GFLOP/s  6.8 GiB
    pi400   Pi 400 (4 GB, 1.8 GHz)                                     6.0 GFLOP/s   3 GiB

The first Pi 400 holds the data. Targets: `auto` within 2 s at 64 devices and 10 s at 128.
Beside each plan's predicted step stands the step the planner of commit 0edfb3b (before
devices of a kind were planned as one class) predicted for the same inputs, read from
bench/planner_speed_baseline.json, which `--record` wrote with that commit's planner package
first on the path:

    git archive 0edfb3b planner | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python bench/planner_speed.py --classroom --repeats 1 --record bench/planner_speed_baseline.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: --record can time another planner package

KINDS = [(5, "1 GiB"), (10, "2 GiB"), (20, "4 GiB"), (8, "1 GiB")]  # GFLOP/s, memory
# the classroom's kinds: (name, memory budget, GFLOP/s); the docstring says what each stands for
CLASSROOM_KINDS = [("pi4-1g", "450 MiB", 4.8), ("pi4-2g", "1.3 GiB", 5.0), ("pi4-4g", "3 GiB", 5.0),
                   ("pi4-8g", "6.8 GiB", 5.2), ("pi400", "3 GiB", 6.0)]
CLASSROOM_SIZES = (8, 16, 32, 64, 128)
CLASSROOM_TARGETS = {64: 2.0, 128: 10.0}  # auto's planning seconds
BASELINE = ROOT / "bench" / "planner_speed_baseline.json"


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


def classroom_cluster(n: int) -> dict:
    """The cluster file of n classroom devices, the kinds dealt round-robin."""
    devices = []
    for i in range(n):
        kind, memory, gflops = CLASSROOM_KINDS[i % len(CLASSROOM_KINDS)]
        devices.append({"name": f"{kind}-{i // len(CLASSROOM_KINDS) + 1}", "memory": memory, "gflops": gflops,
                        "mem_gbps": 4})
    return {"name": f"classroom-{n}",
            "description": f"{n} Raspberry-Pi-4-class devices of five kinds on one gigabit switch, for "
                           "bench/planner_speed.py --classroom: Pi 4 boards of 1, 2, 4 and 8 GB and a Pi 400, dealt "
                           "round-robin. Compute rates and budgets are assumptions in the manner of "
                           "pi-jetson-cluster.json (the bench's docstring lists them).",
            "data_source": "pi400-1", "bandwidth_mbps": 940, "latency_ms": 0.3, "devices": devices}


def classroom_inputs(n: int):
    """What `swarm plan --devices <the classroom file> --batch-size 64 --microbatches 8` plans from."""
    from planner.cluster import cluster_from_dict
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel, plan_allocator
    from swarm.profiling.profiler import default_classes
    from swarm.zoo import describe_model

    desc = describe_model("yolov2-16", 416, default_classes("yolov2-16", 416))
    cluster = cluster_from_dict(classroom_cluster(n), desc, None)
    mem = MemoryModel.for_devices(desc, "sgd", None, plan_allocator(d.facts.get("allocator") for d in cluster.devices))
    return PlanInputs(desc, mem, cluster, 64, 8)


def timed(strategy: str, make_inputs, repeats: int):
    """(best planning seconds, plan or None, why not) over `repeats` runs, each on inputs
    made afresh (the planner's caches of tiles costs are per model, so each run starts cold)."""
    from planner.inputs import NoPlan
    from planner.planners import make_plan

    best, plan, error = float("inf"), None, None
    for _ in range(repeats):
        inputs = make_inputs()
        t0 = time.perf_counter()
        try:
            plan = make_plan(strategy, inputs)
        except NoPlan as exc:
            error = str(exc)
        best = min(best, time.perf_counter() - t0)
    return best, plan, error


def small_scenarios(args) -> None:
    from planner.report import table

    targets = {"yolov2x8": 1.0, "deep200x16": 10.0}
    rows = []
    for name, target in targets.items():
        desc, inputs = scenario(name)
        for strategy in args.only.split(","):
            best, plan, _ = timed(strategy, lambda: scenario(name)[1], args.repeats)
            verdict = "ok" if best <= target else "OVER"
            rows.append([name, f"{len(desc.layers)} layers x {len(inputs.cluster.devices)} devices", strategy,
                         f"{best:.3f}", f"{target:g}", verdict, f"{plan.predicted['step_time_s']:.2f}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(load_line(args.repeats))
    print(table(rows, ["scenario", "size", "strategy", "planning s", "target s", "", "predicted step s"]))


def classroom(args) -> None:
    from planner.report import table

    baseline = {} if args.record or not BASELINE.exists() else json.loads(BASELINE.read_text())["figures"]
    figures, rows = {}, []
    for n in (int(x) for x in args.sizes.split(",")):
        for strategy in args.only.split(","):
            seconds, plan, error = timed(strategy, lambda: classroom_inputs(n), args.repeats)
            step = plan.predicted["step_time_s"] if plan is not None else None
            figures.setdefault(str(n), {})[strategy] = {"seconds": round(seconds, 3), "step_time_s": step,
                                                        "fits": bool(plan.predicted["fits"]) if plan else None}
            old = baseline.get(str(n), {}).get(strategy, {})
            target = CLASSROOM_TARGETS.get(n) if strategy == "auto" else None
            verdict = "" if target is None else ("ok" if seconds <= target else "OVER")
            rows.append([str(n), strategy, f"{seconds:.2f}", _or_dash(old.get("seconds"), ".2f"),
                         f"{target:g}" if target else "", verdict, _or_dash(step, ".3f"),
                         _or_dash(old.get("step_time_s"), ".3f"), _ratio(step, old.get("step_time_s")),
                         "" if error is None else error[:60]])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    if args.record:
        Path(args.record).write_text(json.dumps({"recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                 "repeats": args.repeats, "figures": figures}, indent=1) + "\n")
    print(load_line(args.repeats))
    print(table(rows, ["devices", "strategy", "planning s", "before", "target s", "", "predicted step s", "before",
                       "ratio", "no plan"]))


def _or_dash(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(new, old) -> str:
    return "-" if new is None or old is None else f"{new / old:.4f}"


def load_line(repeats: int) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"best of {repeats}; load average {load:.2f} on {os.cpu_count()} CPUs"


def write_clusters() -> None:
    for n in (16, 32, 64):
        path = ROOT / "examples" / f"classroom-{n}-cluster.json"
        data = classroom_cluster(n)
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in data.items() if k != "devices"]
        lines.append('  "devices": [')
        lines.append(",\n".join(f"    {json.dumps(d)}" for d in data["devices"]))
        path.write_text("{\n" + "\n".join(lines) + "\n  ]\n}\n")
        print(f"wrote {path}")


def main() -> None:
    from planner.planners import STRATEGIES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(STRATEGIES))
    p.add_argument("--classroom", action="store_true", help="the classroom of Pi-4-class devices at several sizes")
    p.add_argument("--sizes", default=",".join(map(str, CLASSROOM_SIZES)), help="classroom sizes")
    p.add_argument("--record", metavar="FILE", help="write the classroom's figures (seconds, predicted steps) to FILE")
    p.add_argument("--write-clusters", action="store_true", help="write examples/classroom-{16,32,64}-cluster.json")
    args = p.parse_args()
    if args.write_clusters:
        write_clusters()
    elif args.classroom:
        classroom(args)
    else:
        small_scenarios(args)


if __name__ == "__main__":
    main()
