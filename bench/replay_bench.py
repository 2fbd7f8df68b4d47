"""Recovery from a lost device on the namespace testbed (root): how long until training
commits again, how fast it goes afterwards, and the same done the heavy way.

    sudo python bench/replay_bench.py [--devices 4] [--cpu 0.5] [--mem 2G] [--bandwidth 100mbit]
        [--model yolov2-16] [--img-size 224] [--strategy pp] [--steps 30] [--kill-at 12]
        [--kill dev2] [--plot throughput.png]

Three runs of the same training, each on a fresh testbed:
  light  `swarm train` as a user runs it; --kill is SIGKILLed when step --kill-at is reported;
         the run rolls back to its last backup (every step), shifts the plan, and replays.
  heavy  the same kill with --recovery heavy: plan again from scratch over the survivors and
         reload the last checkpoint (the coordinator saves one every 5 steps).
  fresh  a new run on the survivors only: the throughput a fresh plan gives them.
Reported: seconds from the kill to the first committed step after it; samples/s after the
recovery (median over the steps that follow it, the first excluded) as a fraction of the
fresh run's; and a picture of samples/s over time for the light and heavy runs (like
Asteroid's Fig. 17) with --plot.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "SWARM_PROGRESS_SECONDS": "0"}


def swarm(*args, check=True, timeout=600):
    r = subprocess.run([sys.executable, "-m", "swarm", *map(str, args)], capture_output=True, text=True, env=ENV,
                       timeout=timeout)
    if check and r.returncode:
        sys.exit(f"swarm {' '.join(map(str, args))} failed:\n{r.stderr}")
    return r


def testbed_up(args, devices: int) -> None:
    swarm("testbed", "down", check=False)
    swarm("testbed", "up", "--devices", devices, "--cpu", args.cpu, "--mem", args.mem, "--bandwidth", args.bandwidth)


def run(args, work: Path, label: str, devices: int, extra: list[str], kill: bool) -> dict:
    """One training run inside dev0's namespace; returns step times, metrics and events."""
    metrics = work / f"{label}.jsonl"
    cmd = [sys.executable, "-m", "swarm", "testbed", "exec", "dev0", "--", sys.executable, "-m", "swarm", "train",
           "--model", args.model, "--img-size", str(args.img_size), "--batch-size", str(args.batch_size),
           "--microbatches", str(args.microbatches), "--steps", str(args.steps), "--seed", "1",
           "--strategy", args.strategy, "--devices", str(devices), "--wait", "60", "--no-eval",
           "--metrics", str(metrics), "--save", str(work / f"{label}.pt"), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV)
    t0 = time.monotonic()
    steps, events = [], []
    for line in proc.stderr:
        now = time.monotonic() - t0
        if line.startswith("step "):
            steps.append((now, int(line.split()[1].split("/")[0])))
            if kill and steps[-1][1] == args.kill_at and not any(e[1] == "kill" for e in events):
                swarm("testbed", "kill", args.kill)
                events.append((time.monotonic() - t0, "kill"))
        elif line.startswith("lost "):
            events.append((now, "recovering"))
            print(f"  [{label}] {line.strip()}")
    proc.wait()
    if proc.returncode:
        sys.exit(f"{label} run failed (exit {proc.returncode})")
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {"label": label, "steps": steps, "events": events, "metrics": records}


def summarise(r: dict) -> dict:
    kill = next((t for t, e in r["events"] if e == "kill"), None)
    if kill is None:
        rates = [m["samples_per_s"] for m in r["metrics"][1:]]
        return {"rate": statistics.median(rates)}
    recovering = next((t for t, e in r["events"] if e == "recovering"), kill)
    after = [t for t, _ in r["steps"] if t > recovering]  # committed by the new plan
    first = after[0] - kill if after else float("nan")
    # steps of the new plan that are not replays, the first one excluded
    fresh = [m["samples_per_s"] for m in r["metrics"] if m.get("epoch", 0) > 0 and not m.get("replayed")][1:]
    return {"recovery_s": first, "rate": statistics.median(fresh) if fresh else float("nan")}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for r, colour in zip(results, ("tab:blue", "tab:orange")):
        xs = [t for t, _ in r["steps"]]
        ys = [m["samples_per_s"] for m in r["metrics"]][:len(xs)]
        ax.plot(xs[:len(ys)], ys, marker=".", color=colour, label=f"{r['label']} recovery")
        for t, e in r["events"]:
            if e == "kill":
                ax.axvline(t, color=colour, linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("samples/s (each step)")
    ax.set_title("training throughput with a device killed (dashed line)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--cpu", default="0.5")
    p.add_argument("--mem", default="2G")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--strategy", default="pp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=12)
    p.add_argument("--kill", default="dev2")
    p.add_argument("--plot", help="write samples/s over time to this PNG")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            testbed_up(args, args.devices)
            results.append(run(args, work, "light", args.devices, [], kill=True))
            testbed_up(args, args.devices)
            results.append(run(args, work, "heavy", args.devices, ["--recovery", "heavy", "--save-every", "5"],
                               kill=True))
            testbed_up(args, args.devices - 1)
            fresh = run(args, work, "fresh", args.devices - 1, [], kill=False)
    finally:
        swarm("testbed", "down", check=False)
    base = summarise(fresh)["rate"]
    print(f"{args.model} at {args.img_size}, batch {args.batch_size} in {args.microbatches}, {args.strategy} over "
          f"{args.devices} devices ({args.cpu} core, {args.mem}, {args.bandwidth}); {args.kill} killed at step "
          f"{args.kill_at}")
    print(f"fresh plan on the {args.devices - 1} survivors: {base:.3f} samples/s")
    for r in results:
        s = summarise(r)
        print(f"{r['label']:>6}: first committed step {s['recovery_s']:.1f} s after the kill; then "
              f"{s['rate']:.3f} samples/s = {s['rate'] / base:.2f} of the fresh plan")
    if args.plot:
        plot(results, args.plot)
        print(f"picture: {args.plot}")


if __name__ == "__main__":
    main()
