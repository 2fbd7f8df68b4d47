"""A lost coordinator on the namespace testbed (root): how long until training commits again
when the agents elect a successor, against the manual way.

    sudo python bench/coordinator_failover.py [--devices 4] [--cpu 0.5] [--bandwidth 100mbit]
        [--model yolov2-16] [--img-size 64] [--steps 40] [--kill-at 12] [--save-every 10]
        [--backup-every N|auto] [--repeat 1]

Two runs of the same training (pp over every device), each on a fresh testbed, the
coordinator on dev1:
  failover  `swarm train --detach --coordinator dev1`; dev1's agent (and with it the run's
            coordinator) is SIGKILLed once step --kill-at has committed; the agents elect a
            successor, which rolls back to the last backup and re-plans over the survivors.
  manual    `swarm train` in the foreground on dev1, saving every --save-every steps; the same
            kill takes dev1's agent and the `swarm train` process; `swarm train --resume` from
            the last checkpoint is started on dev0 at once (a person noticing the failure and
            typing it would add their own reaction time).
Reported per run: seconds from the kill to the first step committed after it, and to the
first step past the one reached before the kill (the replayed steps done again), and how
many steps were done again.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "SWARM_PROGRESS_SECONDS": "0"}
POLL_S = 0.01


def swarm(*args, check=True, timeout=600):
    r = subprocess.run([sys.executable, "-m", "swarm", *map(str, args)], capture_output=True, text=True, env=ENV,
                       timeout=timeout)
    if check and r.returncode:
        sys.exit(f"swarm {' '.join(map(str, args))} failed:\n{r.stderr}")
    return r


def testbed_up(args) -> list:
    from swarm.testbed import testbed

    swarm("testbed", "down", check=False)
    swarm("testbed", "up", "--devices", args.devices, "--cpu", args.cpu, "--bandwidth", args.bandwidth)
    return testbed.load().devices


def train_flags(args) -> list[str]:
    return ["--model", args.model, "--img-size", str(args.img_size), "--batch-size", str(args.batch_size),
            "--microbatches", str(args.microbatches), "--steps", str(args.steps), "--seed", "1", "--strategy", "pp",
            "--devices", str(args.devices), "--wait", "60", "--no-eval", "--save-every", str(args.save_every),
            "--backup-every", args.backup_every]


def committed(path: Path) -> list[tuple[float, int]]:
    """(when it was read, step) of each line of a metrics file, as the file grows: call again."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [(time.time(), json.loads(line)["step"]) for line in lines if line.endswith("}")]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(POLL_S)
    sys.exit(f"timed out waiting for {what}")


def failover_run(args) -> dict:
    devices = testbed_up(args)
    peers = ",".join(f"{d.address}:{d.port}" for d in devices)
    r = swarm("testbed", "exec", "dev0", "--", "swarm", "train", "--detach", "--coordinator", "dev1",
              *train_flags(args), "--peers", peers)
    job = r.stdout.strip()
    folders = {d.name: Path(d.state_dir) / "runs" / job for d in devices}
    first = folders["dev1"] / "metrics.jsonl"
    wait_for(lambda: any(step >= args.kill_at for _, step in committed(first)), 600, f"step {args.kill_at}")
    reached = committed(first)[-1][1]
    swarm("testbed", "kill", "dev1")
    killed = time.time()
    seen: dict[int, float] = {}

    def successor_steps():
        for name, folder in folders.items():
            if name != "dev1":
                for when, step in committed(folder / "metrics.jsonl"):
                    seen.setdefault(step, when)
        return seen and max(seen) > reached

    wait_for(successor_steps, 600, "the successor to get past the step reached before the kill")
    return {"first_commit_s": min(seen.values()) - killed, "caught_up_s": seen[reached + 1] - killed,
            "redone": reached - min(seen) + 1, "reached": reached}


def manual_run(args, work: Path) -> dict:
    testbed_up(args)
    work = Path(tempfile.mkdtemp(dir=work))  # this run's own files (a metrics file is appended to)
    save, metrics = work / "manual.pt", work / "manual.jsonl"
    coordinator = subprocess.Popen([sys.executable, "-m", "swarm", "testbed", "exec", "dev1", "--", sys.executable,
                                    "-m", "swarm", "train", *train_flags(args), "--save", str(save),
                                    "--metrics", str(metrics)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
                                   start_new_session=True)
    wait_for(lambda: any(step >= args.kill_at for _, step in committed(metrics)), 600, f"step {args.kill_at}")
    reached = committed(metrics)[-1][1]
    os.killpg(coordinator.pid, signal.SIGKILL)  # the device dies: its agent and the coordinator on it
    swarm("testbed", "kill", "dev1")
    killed = time.time()
    coordinator.wait()
    resumed_metrics = work / "resumed.jsonl"
    resumed = subprocess.Popen([sys.executable, "-m", "swarm", "testbed", "exec", "dev0", "--", sys.executable, "-m",
                                "swarm", "train", "--resume", str(save), "--strategy", "pp", "--devices",
                                str(args.devices - 1), "--wait", "60", "--metrics", str(resumed_metrics)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    seen: dict[int, float] = {}

    def resumed_steps():
        for when, step in committed(resumed_metrics):
            seen.setdefault(step, when)
        return seen and max(seen) > reached

    try:
        wait_for(resumed_steps, 600, "the resumed run to get past the step reached before the kill")
    finally:
        resumed.kill()
        resumed.wait()
    return {"first_commit_s": min(seen.values()) - killed, "caught_up_s": seen[reached + 1] - killed,
            "redone": reached - min(seen) + 1, "reached": reached}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--cpu", default="0.5", help="each device's CPU share (default 0.5)")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=12)
    p.add_argument("--save-every", type=int, default=10, help="checkpoint interval of both runs (default 10)")
    p.add_argument("--backup-every", default="auto", help="backups of both runs (default auto: by time); the "
                   "successor rolls back to the last one")
    p.add_argument("--repeat", type=int, default=1, help="runs of each way, alternating (medians reported)")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    results: dict[str, list[dict]] = {"failover": [], "manual": []}
    try:
        with tempfile.TemporaryDirectory() as work:
            for _ in range(args.repeat):
                results["failover"].append(failover_run(args))
                results["manual"].append(manual_run(args, Path(work)))
    finally:
        swarm("testbed", "down", check=False)
    print(f"{args.model} {args.img_size}px, batch {args.batch_size} in {args.microbatches}, pp over {args.devices} "
          f"devices ({args.cpu} core, {args.bandwidth} each); coordinator's device killed after step "
          f"{args.kill_at}; checkpoints every {args.save_every}, backups every {args.backup_every}; medians of "
          f"{args.repeat}")
    print(f"{'way':10} {'to first commit':>16} {'to catch up':>12} {'steps redone':>13}")
    for way, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("first_commit_s", "caught_up_s", "redone")}
        print(f"{way:10} {med['first_commit_s']:15.1f}s {med['caught_up_s']:11.1f}s {med['redone']:13.0f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
