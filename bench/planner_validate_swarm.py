"""Predicted vs measured across a swarm: plans run by `swarm train --plan` on the devices of a
testbed, against the simulator's step time for the same plan.

    swarm testbed up --devices 4 --cpu 0.25 --mem 1G --bandwidth 100mbit
    swarm testbed exec dev0 -- python bench/planner_validate_swarm.py --model yolov2-16 --img-size 128 \\
        --batch-size 8 --microbatches 2 --steps 10 --strategies local,dp,pp,asteroid,tiles,hiertrain --rounds 3

Run inside the testbed's network (it coordinates from there, outside the devices' cgroups).
It does what `swarm plan` does on a live swarm: finds the devices, has each agent profile
its device under its own limits (cached there), measures every link with the agents'
bandwidth job (rate, latency, and each device's time per byte and per message moved),
plans each strategy, and trains `--steps` steps of each plan with `swarm train --plan`.
Measured: the median time between consecutive steps' ends after the first `--skip` (from
--metrics). `--profile FILE` uses one profile for every device instead. This host's speed
drifts by 20-30% between runs minutes apart, so `--rounds R` repeats the whole survey
(profiling afresh) and every plan R times and gives each strategy's median error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def survey(spec: dict, wait: float):
    """What `swarm plan` finds on the live swarm: the devices, each one's profile (measured by
    its agent under its own limits, cached there), and every link."""
    from swarm.agent import DEFAULT_PORT
    from swarm.host.state import default_state_dir, find_token, process_id
    from swarm.net import Credentials, parse_peers, resolve_network
    from swarm.profiling.survey import gather_live

    state = default_state_dir()
    token, _ = find_token(None, state, create=False)
    peers = parse_peers(os.environ.get("SWARM_PEERS"), DEFAULT_PORT)
    return await gather_live(Credentials(process_id(state), token), resolve_network(None), peers, spec, wait)


def measured_step(metrics: Path, skip: int) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    ends = [r["wall_s"] for r in rows]
    gaps = [b - a for a, b in zip(ends, ends[1:])][skip - 1:]
    if not gaps:
        raise SystemExit(f"{metrics}: too few steps to measure; give more --steps")
    return statistics.median(gaps)


def per_device(plan, metrics: Path, skip: int) -> str:
    """Each device's predicted computation against what it measured (medians over the steps
    after `skip`): the compute thread's busy wall time, its CPU time, and the whole process's
    CPU time, in seconds per step."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()][skip:]
    out = []
    for d, predicted in sorted(plan.predicted.get("busy_s", {}).items()):
        def med(key):
            vals = [r["device_times"][d][key] for r in rows if d in r.get("device_times", {})]
            return statistics.median(vals) if vals else float("nan")
        out.append(f"  {d}: computing {predicted:.3f} predicted, {med('busy_s'):.3f} measured "
                   f"(compute CPU {med('compute_cpu_s'):.3f}, process CPU {med('cpu_s'):.3f})")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", help="one profile (swarm profile --out) for every device, instead of the agents' own")
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--strategies", default="local,dp,pp,asteroid,tiles")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="steps left out of the measurement (warm-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-source", default="dev0", help="the device this coordinator runs on")
    p.add_argument("--wait", type=float, default=2.0)
    p.add_argument("--keep", metavar="DIR", help="keep the cluster file, plans and metrics here")
    p.add_argument("--rounds", type=int, default=1,
                   help="survey and run every plan this many times (the host's speed drifts between runs: "
                        "each round profiles afresh, and the summary gives each strategy's median error)")
    args = p.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    work = Path(args.keep or tempfile.mkdtemp(prefix="swarm-validate-"))
    errors: dict[str, list[float]] = {}
    for r in range(args.rounds):
        run_round(args, work / f"round{r + 1}" if args.rounds > 1 else work, r > 0 or args.rounds > 1, errors)
    if args.rounds > 1:
        from planner.report import table

        rows = [[s, " ".join(f"{e:+.1f}%" for e in errs), f"{statistics.median(errs):+.1f}%"]
                for s, errs in errors.items()]
        print(f"{args.rounds} rounds, each with fresh profiles; files in {work}")
        print(table(rows, ["strategy", "error by round", "median"]))


def run_round(args, work: Path, fresh: bool, errors: dict) -> None:
    """One survey (profiles measured again if `fresh`) and every strategy's plan trained."""
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel
    from planner.planners import make_plan
    from planner.report import table
    from swarm.errors import run_trio
    from swarm.profiling.profiler import read_profile
    from swarm.profiling.survey import cluster_from_live
    from swarm.zoo import describe_model

    desc = describe_model(args.model, args.img_size)
    spec = {"model": args.model, "img_size": desc.img_size.to_json(), "classes": None, "cfg": None, "threads": args.threads,
            "refresh": fresh}
    live = run_trio(survey, spec, args.wait)
    if live is None:
        raise SystemExit("no device of the swarm answered")
    if args.profile:
        profile = read_profile(Path(args.profile))
        live["profiles"] = {d["node_id"]: profile for d in live["devices"]}
    profile = next(iter(live["profiles"].values()))
    desc = describe_model(args.model, args.img_size, profile.classes)
    cluster = cluster_from_live(live, desc)
    cluster.data_source = args.data_source if args.data_source in cluster.names else None
    inputs = PlanInputs(desc, MemoryModel(desc, profile.act_bytes, measured=True), cluster, args.batch_size,
                        args.microbatches)
    work.mkdir(parents=True, exist_ok=True)
    print(f"devices: {', '.join(cluster.names)}; latency {cluster.latency * 1e3:.2f} ms; rates (Mbit/s): "
          + ", ".join(f"{r['bytes_per_second'] * 8 / 1e6:.0f}" for r in live["links"].values())
          + "; time per byte moved (ns): " + ", ".join(f"{d.name} {d.comm_s_per_byte * 1e9:.0f}" for d in cluster.devices)
          + "; per message (us): " + ", ".join(f"{d.name} {d.msg_s * 1e6:.0f}" for d in cluster.devices),
          file=sys.stderr)
    rows = []
    for strategy in args.strategies.split(","):
        plan = make_plan(strategy, inputs)
        plan_file, metrics = work / f"{strategy}.json", work / f"{strategy}.jsonl"
        plan_file.write_text(plan.to_json())
        metrics.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "swarm", "train", "--model", args.model, "--img-size", str(args.img_size),
               "--plan", str(plan_file), "--batch-size", str(args.batch_size), "--microbatches",
               str(args.microbatches), "--steps", str(args.steps), "--threads", str(args.threads), "--metrics",
               str(metrics), "--no-eval", "--save", str(work / f"{strategy}.pt")]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            print(f"{strategy}: swarm train failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        got = measured_step(metrics, args.skip)
        predicted = plan.predicted["step_time_s"]
        shape = " | ".join(f"{s.first}-{s.last - 1} {s.mode}x{len(s.devices)}" for s in plan.stages)
        rows.append([strategy, shape, f"{predicted:.3f}", f"{got:.3f}", f"{100 * (predicted / got - 1):+.1f}%"])
        errors.setdefault(strategy, []).append(100 * (predicted / got - 1))
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        print(per_device(plan, metrics, args.skip), file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    print(f"{args.model} at {args.img_size}, batch {args.batch_size} in {args.microbatches} micro-batches, "
          f"{args.threads} thread(s) per device; measured: median step of {args.steps - args.skip}; "
          f"load average {load:.2f}; files in {work}")
    print(table(rows, ["strategy", "stages", "predicted s", "measured s", "error"]))


if __name__ == "__main__":
    main()
