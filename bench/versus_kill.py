"""What losing a device costs: swarm's replay against DDP restarted by torchrun's elastic agent (root).

    sudo .venv/bin/python bench/versus_kill.py --devices 8 --cpu 0.2 --mem 1G --bandwidth 100mbit \\
        --batch-size 8 --microbatches 8 --steps 8 --kill dev3 --kill-after-step 3 --runs auto,ddp

Each run trains twice on a fresh testbed, alternating: once without a failure, and once with
every process of device --kill killed (SIGKILL on all its cgroup holds: the device's plug
pulled) half a step after step --kill-after-step has ended, i.e. in the middle of the next.
The cost of the loss is the killed run's time from the end of step 1 to the end of the last
step, less the failure-free run's (a run's start-up is not counted in either).

- swarm: `swarm train --strategy RUN` in dev0's namespace, as bench/versus.py runs it; it
  notices the loss, re-plans over the survivors, rolls back to the last backup and replays.
- ddp: bench/peers/ddp.py under torchrun with an elastic range, one node per device in its
  namespace and cgroups: `--nnodes N-1:N --max-restarts 3 --rdzv-backend c10d
  --rdzv-endpoint DEV0:29500 --rdzv-conf is_host=true|false --local-addr DEVK` (dev0 holds
  the store; the namespaces share the host's name, so each node says its address), rank 0
  writing a checkpoint every --save-every steps (default every step: the least a restart
  replays). After the loss the survivors' agents restart their workers, which meet again
  as N-1 ranks and carry on from the checkpoint.

The time a step ends is when its line appears in the run's --metrics file (polled every
0.1 s). dev0 holds swarm's coordinator and torchrun's rendezvous, so it is not the device
killed (a coordinator's loss is another matter).
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
import threading
import time
from pathlib import Path

from peers import run_ddp as ddp  # bench/peers, beside this file
from versus import Parser, add_testbed_flags, check_testbed_flags, load_swarm_bench, run_list, train_args  # bench/

from swarm.commands.flags import positive_float, positive_int
from swarm.testbed import testbed
from swarm.testbed.names import device_address, device_name

POLL_S = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="versus_kill.py", description=__doc__.splitlines()[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    add_testbed_flags(p)
    p.add_argument("--steps", type=positive_int, default=8)
    p.add_argument("--kill", default="dev3", help="the device lost (not dev0; default: dev3)")
    p.add_argument("--kill-after-step", type=positive_int, default=3, help="the loss comes in the step after this")
    p.add_argument("--save-every", type=positive_int, default=1, help="ddp's checkpoint interval in steps")
    p.add_argument("--repeat", type=positive_int, default=1, help="rounds (default: 1)")
    p.add_argument("--runs", type=run_list, default="auto,ddp", help="which runs (default: auto,ddp)")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds one run may take (default: 1800)")
    p.add_argument("--json", metavar="FILE", help="also write the raw results here")
    args = p.parse_args(argv)
    check_testbed_flags(p, args)
    names = [device_name(k) for k in range(1, args.devices)]
    if args.kill not in names:
        p.error(f"--kill must be one of {', '.join(names)} (dev0 holds the coordinator and the rendezvous)")
    if not 1 <= args.kill_after_step < args.steps - 1:
        p.error(f"--kill-after-step must leave at least two steps after it (--steps {args.steps})")
    return args


class StepClock:
    """Watches a metrics file: when each step's line first and last appeared."""

    def __init__(self, path: Path):
        self.path = path
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.poll()
            time.sleep(POLL_S)

    def poll(self) -> None:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return
        now = time.monotonic()
        for line in lines[self._seen:]:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                return  # a line still being written: read it whole next time
            self.first.setdefault(step, now)
            self.last[step] = now
            self._seen += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()


def pull_the_plug(name: str) -> int:
    """SIGKILL every process in the device's cgroups; how many there were."""
    pids = set()
    for directory in testbed.require().device(name).cgroups:
        try:
            pids |= {int(x) for x in (Path(directory) / "cgroup.procs").read_text().split()}
        except OSError:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def elastic_node_command(k: int, n: int, ddp_args: list) -> list[str]:
    """Node k of an elastic job of n - 1 to n nodes (torchrun's c10d rendezvous on dev0)."""
    return [sys.executable, "-m", "swarm", "testbed", "exec", "--in-cgroup", device_name(k), "--",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{n - 1}:{n}", "--nproc-per-node", "1",
            "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{device_address(0)}:{ddp.MASTER_PORT}", "--rdzv-id", "versus-kill",
            # namespaces share the host's name: say which node holds the store, and each node's
            # own address (what the workers' process group is reached at)
            "--rdzv-conf", f"is_host={'true' if k == 0 else 'false'}", "--local-addr", device_address(k),
            str(ddp.DDP),
            *map(str, ddp_args)]


def start(bench, run: str, args: argparse.Namespace, work: Path, label: str) -> tuple[list[subprocess.Popen], Path]:
    """Start a run; its processes (for ddp one per device, dev0's first) and its metrics file."""
    metrics = work / f"{label}.jsonl"
    logs = work / label
    logs.mkdir(parents=True, exist_ok=True)
    if run == "ddp":
        ddp_args = [*train_args(args), "--checkpoint", work / f"{label}.ckpt", "--save-every", args.save_every,
                    "--metrics", metrics]
        procs = []
        for k in range(args.devices):
            with open(logs / f"ddp-{device_name(k)}.log", "w") as log:
                procs.append(subprocess.Popen(elastic_node_command(k, args.devices, ddp_args), stdout=log,
                                              stderr=subprocess.STDOUT, env=ddp.environment(),
                                              start_new_session=True))
        return procs, metrics
    with open(logs / "swarm.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "swarm", "testbed", "exec", "dev0", "--", sys.executable,
                                 "-m", "swarm", "train", *map(str, train_args(args)), "--strategy", run, "--devices",
                                 str(args.devices), "--metrics", str(metrics), "--no-eval", "--save",
                                 str(metrics.with_suffix(".pt"))],
                                stdout=log, stderr=subprocess.STDOUT, env=bench.ENV, start_new_session=True)
    return [proc], metrics


def measure(bench, run: str, args: argparse.Namespace, work: Path, label: str, kill: bool) -> dict:
    """One run on a fresh testbed, with or without the loss: its step times, or the error."""
    bench.restart_testbed()
    procs, metrics = start(bench, run, args, work, label)
    clock = StepClock(metrics)
    killed_at = None
    deadline = time.monotonic() + args.timeout
    victim = int(args.kill.removeprefix("dev")) if run == "ddp" else None
    try:
        while time.monotonic() < deadline:
            if kill and killed_at is None and args.kill_after_step in clock.first:
                ends = sorted(clock.first.values())
                step_s = statistics.median(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else 5.0
                if time.monotonic() >= clock.first[args.kill_after_step] + step_s / 2:
                    pull_the_plug(args.kill)
                    killed_at = time.monotonic()
            waited = [p for k, p in enumerate(procs) if k != victim or not kill]
            if all(p.poll() is not None for p in waited):
                break
            time.sleep(POLL_S)
        else:
            return {"error": f"timed out after {args.timeout:g} s", "label": label}
    finally:
        clock.stop()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [k for k, p in enumerate(procs) if p.returncode and (k != victim or not kill)]
    if failed or args.steps not in clock.last:
        log = work / label / ("swarm.log" if run != "ddp" else f"ddp-{device_name(failed[0] if failed else 0)}.log")
        return {"error": ddp.last_error(log.read_text(errors="replace")), "label": label}
    ranks = [json.loads(line).get("ranks") for line in metrics.read_text().splitlines()] if run == "ddp" else []
    return {"label": label, "run": run, "killed": kill, "span_s": clock.last[args.steps] - clock.first[1],
            "killed_after_end_of_step_s": killed_at - clock.first[args.kill_after_step] if killed_at else None,
            "steps_logged": sum(1 for _ in metrics.read_text().splitlines()), "ranks": ranks}


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        sys.exit("versus_kill.py: the namespace testbed needs root")
    bench = load_swarm_bench()
    bench.TESTBED[:] = ["--devices", args.devices, "--cpu", args.cpu, "--mem", args.mem, "--bandwidth", args.bandwidth]
    print(f"testbed: {args.devices} devices, cpu {args.cpu}, mem {args.mem}, bandwidth {args.bandwidth}; {args.model} at "
          f"{args.img_size}, batch {args.batch_size} in {args.microbatches}, {args.steps} steps; {args.kill} lost in "
          f"step {args.kill_after_step + 1}", file=sys.stderr, flush=True)
    results: dict[str, list[dict]] = {run: [] for run in args.runs}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.repeat):
                for run in args.runs if k % 2 == 0 else args.runs[::-1]:
                    for kill in (False, True) if k % 2 == 0 else (True, False):
                        r = measure(bench, run, args, Path(tmp), f"{run}-{'kill' if kill else 'clean'}-{k + 1}", kill)
                        results[run].append(r)
                        print(f"  {r['label']:<16} " + (f"failed: {r['error']}" if "error" in r else
                                                         f"{r['span_s']:.1f} s from step 1 to {args.steps}"),
                              file=sys.stderr, flush=True)
    finally:
        bench.swarm("testbed", "down", check=False)
    print(f"{'run':<8} {'failure-free':>13} {'with the loss':>14} {'the loss cost':>14}")
    for run, rounds in results.items():
        clean = [r["span_s"] for r in rounds if "error" not in r and not r["killed"]]
        lost = [r["span_s"] for r in rounds if "error" not in r and r["killed"]]
        if clean and lost:
            a, b = statistics.median(clean), statistics.median(lost)
            print(f"{run:<8} {a:>11.1f} s {b:>12.1f} s {b - a:>12.1f} s")
        else:
            print(f"{run:<8} failed: " + "; ".join(r["error"] for r in rounds if "error" in r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
