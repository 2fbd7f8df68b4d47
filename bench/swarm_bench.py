"""Training throughput across the namespace testbed with Raspberry-Pi-class devices (root).

    sudo python bench/swarm_bench.py [--devices 8] [--cpu 0.2] [--mem 1G] [--bandwidth 100mbit]
                                     [--tiles 1,2,4,8] [--dp] [--yolov2 [--yolov2-size 160]] [--schedules]
                                     [--steps 4] [--img-size 416]

For each configuration it brings up a fresh testbed of --devices devices and runs, inside
dev0's namespace, the command a user would type:

    swarm train --model yolov2-16 --img-size 416 --batch-size 8 --microbatches 8 --steps 4
                --strategy tiles --devices N --metrics FILE --no-eval

and reports samples/s as the median over the steps after the first (which includes the
agents loading torch), the speedup over the best of the runs on one device (a one-stage plan
on an agent, and tiles over 1, with the same batch and micro-batches), and the largest peak resident memory of an agent
during the run above its idle size (torch included: an idle agent has not loaded it).
With --dp it adds yolov2-16 with dp over each N (devices take whole micro-batches when a
micro-batch has fewer samples than devices); with --yolov2 the full yolov2 (at --yolov2-size)
with pp and dp over all devices (a run the devices cannot hold is refused by swarm train,
and its reason printed); with --schedules,
yolov2-16 in a pipeline over all devices on the 1F1B and on the GPipe schedule.
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
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def swarm(*args, check=True, timeout=3600) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "swarm", *map(str, args)], capture_output=True, text=True, env=ENV,
                       timeout=timeout)
    if check and r.returncode:
        sys.exit(f"swarm {' '.join(map(str, args))} failed:\n{r.stderr}")
    return r


def agents() -> dict[str, int]:
    status = json.loads(swarm("testbed", "status", "--json").stdout)
    return {d["device"]: d["pid"] for d in status["devices"]}


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def train_in_cluster(args: list[str], metrics: Path) -> subprocess.CompletedProcess:
    return swarm("testbed", "exec", "dev0", "--", sys.executable, "-m", "swarm", "train", *args,
                 "--metrics", metrics, "--no-eval", "--save", metrics.with_suffix(".pt"), check=False)


TESTBED: list = []  # the `swarm testbed up` arguments


def restart_testbed() -> None:
    swarm("testbed", "down", check=False)
    swarm("testbed", "up", *TESTBED, timeout=300)


def oom_lines(n: int) -> list[str]:
    r = subprocess.run(["dmesg"], capture_output=True, text=True)
    return [line.split("] ", 1)[-1] for line in r.stdout.splitlines() if "Killed process" in line][-n:] or ["?"]


def show(r: dict, one: float | None) -> None:
    if "error" in r:
        print(f"{r['label']:<28} failed: {r['error']}", flush=True)
        return
    if r["used"] != r["devices"]:
        print(f"{r['label']:<28} ran on {r['used']} devices instead of {r['devices']}: not a measurement of it",
              flush=True)
        return
    speedup = r["samples_per_s"] / one if one else float("nan")
    print(f"{r['label']:<28} {r['samples_per_s']:>10.3f} {speedup:>8.2f} {speedup / r['devices']:>10.2f} "
          f"{r['peak_above_idle_mib']:>20.0f}", flush=True)


def measure(label: str, args: list[str], used: int, work: Path) -> dict:
    restart_testbed()  # fresh agents: what an earlier run left in an agent's heap would hide this one's peak
    pids = agents()
    names = sorted(pids)  # whichever devices the plan picks: the others stay at their idle size
    idle = {}
    for name in names:
        Path(f"/proc/{pids[name]}/clear_refs").write_text("5")  # reset the peak resident size
        idle[name] = rss_kib(pids[name], "VmRSS")
    metrics = work / f"{label.replace(' ', '_')}.jsonl"
    t0 = time.monotonic()
    r = train_in_cluster(args, metrics)
    wall = time.monotonic() - t0
    gone = [n for n in names if not Path(f"/proc/{pids[n]}").exists()]
    if gone:  # the cgroup's memory limit killed an agent: bring the testbed back for the next run
        restart_testbed()
        return {"label": label, "error": f"the agent of {', '.join(gone)} was killed (out of memory: "
                f"{'; '.join(oom_lines(3))})", "wall_s": wall}
    peaks = {n: rss_kib(pids[n], "VmHWM") - idle[n] for n in names}
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"label": label, "error": last, "wall_s": wall}
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [s["samples_per_s"] for s in steps[1:]] or [steps[0]["samples_per_s"]]
    stages = [line.strip() for line in (r.stdout + r.stderr).splitlines() if line.strip().startswith("stage ")]
    return {"label": label, "samples_per_s": statistics.median(rates), "rates": rates, "wall_s": wall,
            "peak_above_idle_mib": max(peaks.values()) / 1024, "devices": used, "plan": stages,
            "cpu_s": {d: t.get("cpu_s") for d, t in steps[-1].get("device_times", {}).items()},
            "used": max(len(s.get("device_times", {})) for s in steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cpu", default="0.2")
    p.add_argument("--mem", default="1G")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--tiles", default="1,2,4,8")
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dp", action="store_true", help="also yolov2-16 with dp over each N of --tiles")
    p.add_argument("--yolov2", action="store_true", help="also full yolov2 with pp and dp over all devices")
    p.add_argument("--yolov2-size", type=int, default=160, help="the full yolov2's input size (default 160: from "
                   "224 up its even-FLOPs pipeline stages come too close to 1 GiB devices' memory, and its dp "
                   "copies of the whole model, with their roll-back snapshots, never fit there)")
    p.add_argument("--tiles-microbatches", type=int, metavar="M", help="also each tiles run with M micro-batches "
                   "(fewer, larger exchanges; the tiles hold only their share of the larger micro-batch)")
    p.add_argument("--one-at-a-time", action="store_true", help="also each tiles run with --together 1 (micro-batches "
                   "one after another instead of as many at a time as fit)")
    p.add_argument("--schedules", action="store_true", help="also yolov2-16 pp over all devices with the 1F1B "
                   "and the GPipe order, for their memory")
    p.add_argument("--keep", action="store_true", help="leave the testbed up afterwards")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    TESTBED[:] = ["--devices", args.devices, "--cpu", args.cpu, "--mem", args.mem, "--bandwidth", args.bandwidth]
    common = ["--img-size", args.img_size, "--batch-size", args.batch_size, "--microbatches", args.microbatches,
              "--steps", args.steps, "--seed", 1]
    print(f"testbed: {args.devices} devices, {args.cpu} core, {args.mem}, {args.bandwidth} each; "
          f"{args.img_size}x{args.img_size}, batch {args.batch_size} in {args.microbatches} micro-batches")
    print(f"{'run':<28} {'samples/s':>10} {'speedup':>8} {'per device':>10} {'peak MiB above idle':>20}", flush=True)
    results = []

    def run(label: str, train_args: list, used: int) -> None:
        results.append(measure(label, train_args, used, work))
        one = max([r.get("samples_per_s", 0.0) for r in results if r.get("devices") == 1 and r.get("used") == 1]
                  or [0.0]) or None
        show(results[-1], one)  # speedup over the best run on one device so far

    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if args.tiles.strip():
                run("yolov2-16 on 1 device", ["--model", "yolov2-16", *common, "--strategy", "pp", "--stages", 1,
                                              "--devices", 1], 1)
            for n in [int(x) for x in args.tiles.split(",") if x.strip()]:
                run(f"yolov2-16 tiles over {n}", ["--model", "yolov2-16", *common, "--strategy", "tiles",
                                                  "--devices", n], n)
                if args.one_at_a_time:
                    run(f"yolov2-16 tiles over {n}, 1 at a time", ["--model", "yolov2-16", *common, "--strategy",
                                                                   "tiles", "--together", 1, "--devices", n], n)
                if args.dp and n > 1:
                    run(f"yolov2-16 dp over {n}", ["--model", "yolov2-16", *common, "--strategy", "dp",
                                                   "--devices", n], n)
                if args.tiles_microbatches:
                    m = args.tiles_microbatches
                    run(f"yolov2-16 tiles over {n}, M={m}", ["--model", "yolov2-16", *common, "--microbatches", m,
                                                            "--strategy", "tiles", "--devices", n], n)
            if args.schedules:
                for schedule in ("1f1b", "gpipe"):
                    run(f"yolov2-16 pp {schedule} over {args.devices}",
                        ["--model", "yolov2-16", *common, "--strategy", "pp", "--schedule", schedule,
                         "--devices", args.devices], args.devices)
            if args.yolov2:
                n = args.devices
                for strategy in ("pp", "dp"):
                    run(f"yolov2 at {args.yolov2_size} {strategy} over {n}",
                        ["--model", "yolov2", *common, "--img-size", args.yolov2_size, "--strategy", strategy,
                         "--devices", n], n)
    finally:
        if not args.keep:
            swarm("testbed", "down", check=False)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
