"""Swarm's strategies against plain PyTorch DDP on one testbed configuration, alternating, medians (root).

The issue's two configurations (8 equal devices; 6 unequal ones):

    sudo .venv/bin/python bench/versus.py --devices 8 --cpu 0.2 --mem 1G --bandwidth 100mbit \\
        --batch-size 8 --microbatches 8 --runs auto,dp,tiles,ddp --steps 4 --repeat 2
    sudo .venv/bin/python bench/versus.py --devices 6 --cpu 0.1,0.1,0.2,0.2,0.4,0.6 \\
        --mem 1G,1G,1G,1G,1G,2G --bandwidth 100mbit --batch-size 32 --microbatches 8 \\
        --runs auto,dp,tiles,ddp --steps 4 --repeat 2

Every run starts on a fresh testbed (`swarm testbed up --devices N --cpu --mem --bandwidth`, so
each device's cgroup counts its peak memory from zero). A swarm run is the command a user
would type, inside dev0's namespace (as bench/swarm_bench.py runs it):

    swarm train --model yolov2-16 --img-size 416 --batch-size B --microbatches M --steps S --seed 1
                --strategy RUN --devices N --metrics FILE --no-eval --augment off

(without augmentation, as the peers train: the runs compare training, not the data pipeline)

A swarm run's name may end in `@glibc`: the same run with every swarm process on glibc
(SWARM_MALLOC=glibc), as a system without jemalloc and without apt runs it, where a run without it
is on jemalloc (installed by `deploy/install.sh`, or fetched by swarm: swarm.host.malloc). `--runs ddp,auto,auto@glibc` measures the gap between
the two installs against each other and DDP in one run, alternating. A name may end in
`@inloop` instead: the same run with its gradient sums moved by the event loop rather than on
lanes of their own (SWARM_SUM_LANES=0, swarm/execution/lane.py).

(`fixed` is auto with `--recost off`: its first plan kept, never re-costed on the devices'
measured speeds; its re-costing, when auto does it, is printed under the run and kept in
--json), ddp is bench/peers/ddp.py under torchrun, one node inside each device's namespace and
cgroups (bench/peers/run_ddp.py), and pipe is bench/peers/pipe.py the same way: torch's own
pipeline (torch.distributed.pipelining, Schedule1F1B), one stage per device; alone is every
device training its own share of the batch (batch / devices) with `swarm train --strategy
local`, all at once, each in its cgroup, exchanging nothing: the sum of their rates is what the
devices compute together on this host, whose cores they share (a ceiling for every run, lower
than one device's rate times the devices when the host is the limit). Each round runs
every run once, in the order of --runs, reversed every other round (so neither gains from the
machine's drift).

The table: samples/s is the median over rounds of each run's median over its steps after the
first (the first includes starting up); peak memory the largest over rounds and devices of a
device's cgroup peak (cgroup v2 memory.peak, v1 memory.max_usage_in_bytes: its agent and,
for ddp, torchrun and its worker, page cache included) and, beside it, the largest of its
anonymous memory read every 0.2 s (without the page cache, which is reclaimed before a
process is killed for memory); per device, both are in --json, with each device's major page
faults (code and files read again from disk after the kernel reclaimed them); for auto,
what the planner predicted for the plan the run started with (swarm train prints it under
the plan), as samples/s; for a run that does not print it, what `swarm plan` on the same
devices predicts afterwards, marked "(other plan)" when that is not the plan the run ran.
Under the table, where `alone` or `ddp` ran, each run's rate against theirs: the ratio of the
medians, and each round's (the runs of a round ran next to each other). Against `alone` it is
the share of what the devices compute together on this host.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from peers.run_ddp import PIPE, last_error, out_of_memory, run_ddp, run_peer  # bench/peers, beside this file
from planner.plan import Plan
from swarm.commands.flags import positive_float, positive_int
from swarm.commands.testbed_cmd import bandwidth_rate, each, memory_size
from swarm.host.malloc import jemalloc_library
from swarm.host.peaks import Peaks
from swarm.testbed import testbed

HERE = Path(__file__).resolve().parent
SWARM_RUNS = ("auto", "dp", "pp", "tiles", "hybrid")
PREDICTED = re.compile(r"^predicted on [a-z ]+: ([0-9.]+) samples/s, ([0-9.]+) s a step$")
# plan: the plan file --plan names (`swarm plan --out`); fixed: auto's first plan, never re-costed (--recost off);
# alone: every device trains its share of the batch by itself, all at once (no exchange): the ceiling on this host
RUNS = (*SWARM_RUNS, "fixed", "plan", "ddp", "pipe", "alone")
ON_GLIBC = "@glibc"  # a swarm run's suffix: every swarm process on glibc (SWARM_MALLOC=glibc)
IN_LOOP = "@inloop"  # a swarm run's suffix: gradient sums through the event loop, no lanes (SWARM_SUM_LANES=0)
SUFFIXES = {ON_GLIBC: ("SWARM_MALLOC", "glibc"), IN_LOOP: ("SWARM_SUM_LANES", "0")}


class Parser(argparse.ArgumentParser):
    """Mistakes in the flags: one line, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def load_swarm_bench():
    spec = importlib.util.spec_from_file_location("swarm_bench", HERE / "swarm_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_device(kind):
    """An argument type: one value of `kind` or a comma list (one per device), checked, kept as text."""
    def parse(text: str) -> str:
        each(kind)(text)
        return text
    parse.__name__ = kind.__name__
    return parse


def run_list(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in runs if base_run(r) not in RUNS or (r != base_run(r) and base_run(r) in ("ddp", "pipe"))]
    if unknown or not runs:
        raise argparse.ArgumentTypeError(f"'{','.join(unknown) or text}' is not a run; choose from {','.join(RUNS)} "
                                         f"(a swarm run may end in {ON_GLIBC} or {IN_LOOP})")
    if len(set(runs)) < len(runs):
        raise argparse.ArgumentTypeError(f"'{text}' names a run twice")
    return runs


def base_run(run: str) -> str:
    """The run a name measures, without its suffix (SUFFIXES)."""
    suffix = next((s for s in SUFFIXES if run.endswith(s)), "")
    return run[:-len(suffix)] if suffix else run


def allocator_for(bench, run: str):
    """The environment the testbed's agents, their commands and `alone`'s trainings start with:
    SWARM_MALLOC=glibc for a run ON_GLIBC, SWARM_SUM_LANES=0 for one IN_LOOP (both put back
    after it), as it is otherwise."""
    if run == base_run(run):
        return contextlib.nullcontext()
    name, value = SUFFIXES[run[len(base_run(run)):]]
    stack = contextlib.ExitStack()
    for env in (bench.ENV, os.environ):
        stack.enter_context(mock.patch.dict(env, {name: value}))
    return stack


def add_testbed_flags(p: argparse.ArgumentParser) -> None:
    """The testbed's devices and the training job every run shares."""
    p.add_argument("--devices", type=positive_int, default=8, help="testbed devices, all used by every run")
    p.add_argument("--cpu", type=per_device(positive_float), default="0.2", help="cores per device, or one each")
    p.add_argument("--mem", type=per_device(memory_size), default="1G", help="memory per device, or one each")
    p.add_argument("--bandwidth", type=per_device(bandwidth_rate), default="100mbit",
                   help="link cap per device, or one each")
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=positive_int, default=416)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--microbatches", type=positive_int, default=8)


def check_testbed_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("cpu", "mem", "bandwidth"):
        count = len(getattr(args, flag).split(","))
        if count not in (1, args.devices):
            p.error(f"--{flag} gives {count} values for {args.devices} devices (give one, or one per device)")


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="versus.py", description=__doc__.splitlines()[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    add_testbed_flags(p)
    p.add_argument("--steps", type=positive_int, default=4)
    p.add_argument("--repeat", type=positive_int, default=2, help="rounds (default: 2)")
    p.add_argument("--runs", type=run_list, default="auto,dp,tiles,ddp",
                   help=f"which runs, of {','.join(RUNS)} (default: auto,dp,tiles,ddp)")
    p.add_argument("--timeout", type=positive_float, default=1800, help="seconds one run may take (default: 1800)")
    p.add_argument("--plan", metavar="PLAN.json", help="the plan the run 'plan' trains (as `swarm plan --out` writes)")
    p.add_argument("--json", metavar="FILE", help="also write the raw results here")
    p.add_argument("--logs", metavar="DIR", help="keep every device's agent log of each run here, as "
                   "DIR/RUN-ROUND/devK.log, and what swarm's coordinator printed as DIR/RUN-ROUND/coordinator.log "
                   "(a testbed's logs go with it when the next run starts)")
    args = p.parse_args(argv)
    check_testbed_flags(p, args)
    if any(base_run(r) == "plan" for r in args.runs) != bool(args.plan):
        p.error("--plan and the run 'plan' go together")
    if args.plan and not Path(args.plan).is_file():
        p.error(f"no plan file {args.plan}")
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step, which starts everything up, is not counted)")
    on_glibc = [r for r in args.runs if r.endswith(ON_GLIBC)]
    if on_glibc and (os.environ.get("SWARM_MALLOC", "").lower() in ("glibc", "system")
                     or jemalloc_library(fetch=True) is None):
        p.error(f"'{on_glibc[0]}' would run on glibc as '{base_run(on_glibc[0])}' does: jemalloc is neither installed "
                "nor fetched here (swarm.host.malloc), or SWARM_MALLOC keeps every run on glibc")
    return args


def train_args(args: argparse.Namespace) -> list:
    return ["--model", args.model, "--img-size", args.img_size, "--batch-size", args.batch_size,
            "--microbatches", args.microbatches, "--steps", args.steps, "--seed", 1]


def peak_memory() -> dict[str, int]:
    """Each device's cgroup peak memory in bytes (devices whose cgroup does not say are left out)."""
    peaks = {}
    for d in testbed.require().devices:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            files = [Path(c) / name for c in d.cgroups if (Path(c) / name).exists()]
            if files:
                peaks[d.name] = int(files[0].read_text())
                break
    return peaks


def memory_stat() -> dict[str, dict[str, int]]:
    """Each device's cgroup memory.stat (v1 or v2), as numbers."""
    stats = {}
    for d in testbed.require().devices:
        for c in d.cgroups:
            stat = Path(c) / "memory.stat"
            if stat.exists():
                fields = [line.split() for line in stat.read_text().splitlines()]
                stats[d.name] = {f[0]: int(f[1]) for f in fields if len(f) == 2 and f[1].isdigit()}
                break
    return stats


def resident_memory() -> dict[str, int]:
    """Each device's anonymous memory now, in bytes (cgroup v2 memory.stat anon, v1 rss, which
    counts the transparent huge pages that rss_huge shows again): what its processes hold,
    without the page cache the kernel reclaims first."""
    return {d: f["anon"] if "anon" in f else f.get("rss", 0) for d, f in memory_stat().items()}


def swarm_train(bench, run: str, args: argparse.Namespace, metrics: Path) -> dict:
    """`swarm train --strategy RUN` in dev0's namespace; its steps and plan, or the error."""
    try:
        r = bench.swarm("testbed", "exec", "dev0", "--", sys.executable, "-m", "swarm", "train", *train_args(args),
                        *(["--plan", Path(args.plan).resolve()] if run == "plan" else
                          ["--strategy", "auto", "--recost", "off", "--devices", args.devices] if run == "fixed" else
                          ["--strategy", run, "--devices", args.devices]), "--metrics", metrics, "--no-eval",
                        "--augment", "off",
                        "--save", metrics.with_suffix(".pt"), check=False, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": out_of_memory() or f"timed out after {args.timeout:g} s"}
    oom = out_of_memory()
    if oom or r.returncode:
        return {"error": oom or last_error(r.stderr), "output": r.stdout + r.stderr}
    return {"steps": [json.loads(line) for line in metrics.read_text().splitlines()], "output": r.stdout + r.stderr,
            **read_output(r.stdout + r.stderr)}


def train_alone(args: argparse.Namespace, metrics: Path, logs: Path) -> dict:
    """Every device at once, each in its own cgroup, trains its share of the batch (batch /
    devices, one micro-batch) by itself with `swarm train --strategy local`: what the devices
    compute together when nothing is exchanged, on this host whose cores they share. A step's
    rate is the sum of the devices' rates at that step."""
    from peers.run_ddp import environment, stop, wait_nodes
    from swarm.testbed.names import device_name

    share = max(1, args.batch_size // args.devices)
    logs.mkdir(parents=True, exist_ok=True)
    nodes, files = [], []
    for k in range(args.devices):
        files.append(metrics.with_name(f"{metrics.stem}-{device_name(k)}.jsonl"))
        command = [sys.executable, "-m", "swarm", "testbed", "exec", "--in-cgroup", device_name(k), "--",
                   sys.executable, "-m", "swarm", "train", "--strategy", "local", "--model", args.model, "--img-size",
                   str(args.img_size), "--batch-size", str(share), "--steps", str(args.steps), "--seed", "1",
                   "--metrics", str(files[-1]), "--no-eval", "--augment", "off", "--save",
                   str(files[-1].with_suffix(".pt"))]
        with open(logs / f"alone-{device_name(k)}.log", "w") as log:
            nodes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment(),
                                          start_new_session=True))
    failed, timed_out = wait_nodes(nodes, args.timeout)
    stop(nodes)
    if failed is not None or timed_out:
        return {"error": out_of_memory() or (f"timed out after {args.timeout:g} s" if timed_out else
                                             f"{device_name(failed)} failed: see {logs}")}
    per_device = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
    steps = [{"step": i + 1, "samples_per_s": sum(d[i]["samples_per_s"] for d in per_device),
              "per_device": [d[i]["samples_per_s"] for d in per_device]} for i in range(args.steps)]
    return {"steps": steps}


def read_output(text: str) -> dict:
    """From what swarm train printed: the plan it started with ("plan" and "stage" lines),
    what re-costing measured, chose (its plan's lines) and did ("recost"), and what the
    planner predicted for the first plan ("predicted_samples_per_s", "predicted_step_s")."""
    plan, recost, own = [], [], {}
    for line in (line.strip() for line in text.splitlines()):
        found = PREDICTED.search(line)
        if found and not own:
            own = {"predicted_samples_per_s": float(found[1]), "predicted_step_s": float(found[2]),
                   "predicted_plan": None, "same_plan": True}
        elif "measured compute against" in line or "re-planned from" in line or "re-costed plan (" in line:
            recost.append(line)
        elif line.startswith("plan (") or line.startswith("stage "):
            (recost if any("re-costed plan (" in r for r in recost) else plan).append(line)
    return {"plan": plan, "recost": recost, **own}


def predicted(bench, args: argparse.Namespace, ran: list[str]) -> dict:
    """The planner's prediction for auto on these devices (`swarm plan` in dev0's namespace)."""
    r = bench.swarm("testbed", "exec", "dev0", "--", sys.executable, "-m", "swarm", "plan", "--model", args.model,
                    "--img-size", args.img_size, "--batch-size", args.batch_size, "--microbatches",
                    args.microbatches, "--wait", 5, "--json", check=False, timeout=600)
    try:
        plan = Plan.from_json(r.stdout)
    except ValueError:
        return {"predicted_error": last_error(r.stderr)}
    lines = [line.strip() for line in plan.describe().splitlines()]
    return {"predicted_step_s": plan.predicted["step_time_s"], "predicted_samples_per_s": plan.predicted["throughput"],
            "predicted_plan": lines, "same_plan": lines == ran}


def keep_logs(into: Path, output: str | None = None) -> None:
    """Copy each device's agent log (what it printed, an out-of-memory kill's last words included) into `into`,
    and what the coordinator printed (its plans and re-plans) as coordinator.log."""
    into.mkdir(parents=True, exist_ok=True)
    if output is not None:
        (into / "coordinator.log").write_text(output)
    for d in testbed.require().devices:
        if Path(d.log).exists():
            shutil.copyfile(d.log, into / f"{d.name}.log")


def measure(bench, name: str, args: argparse.Namespace, work: Path, label: str) -> dict:
    """One run on a fresh testbed: its rates, the devices it used, the devices' peak memory."""
    with allocator_for(bench, name):
        return _measure(bench, name, args, work, label)


def _measure(bench, name: str, args: argparse.Namespace, work: Path, label: str) -> dict:
    run = base_run(name)
    bench.restart_testbed()
    metrics = work / f"{label}.jsonl"
    t0 = time.monotonic()
    with Peaks(resident_memory, 0.2) as resident:
        if run == "ddp":
            result = run_ddp(args.devices, train_args(args), metrics, work / label, args.timeout)
        elif run == "pipe":
            result = run_peer(PIPE, args.devices, train_args(args), metrics, work / label, args.timeout)
        elif run == "alone":
            result = train_alone(args, metrics, work / label)
        else:
            result = swarm_train(bench, run, args, metrics)
    result.update(run=name, label=label, wall_s=time.monotonic() - t0, peak_bytes=peak_memory(),
                  resident_bytes=resident.peak or {},
                  major_faults={d: f.get("pgmajfault", 0) for d, f in memory_stat().items()})
    if args.logs:
        keep_logs(Path(args.logs) / label, result.pop("output", None))
    result.pop("output", None)
    if "error" in result:
        return result
    steps = result["steps"]
    result["rates"] = [s["samples_per_s"] for s in steps[1:]]
    result["samples_per_s"] = statistics.median(result["rates"])
    result["used"] = max((len(s.get("device_times", {})) for s in steps), default=0) or args.devices
    if run in ("auto", "fixed") and "predicted_samples_per_s" not in result:
        result.update(predicted(bench, args, result["plan"]))
    return result


def progress(r: dict) -> None:
    if "error" in r:
        text = f"failed: {r['error']}"
    else:
        text = (f"{r['samples_per_s']:.3f} samples/s (steps {', '.join(f'{x:.3f}' for x in r['rates'])}) on "
                f"{r['used']} devices")
    print(f"  {r['label']:<10} {text}; {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    for line in r.get("recost", []):
        print(f"             {line}", file=sys.stderr, flush=True)


def summarise(run: str, rounds: list[dict]) -> list[str]:
    """One table row for a run over its rounds."""
    ok = [r for r in rounds if "error" not in r]
    per_round = ", ".join("failed" if "error" in r else f"{r['samples_per_s']:.3f}" for r in rounds)
    peaks = [(v, d) for r in rounds for d, v in r["peak_bytes"].items()]
    peak = max(peaks) if peaks else None
    held = [(v, d) for r in rounds for d, v in r.get("resident_bytes", {}).items()]
    held = max(held) if held else None
    guesses = [r["predicted_samples_per_s"] for r in ok if "predicted_samples_per_s" in r]
    guess = f"{statistics.median(guesses):.3f}" if guesses else "-"
    if guesses and not all(r.get("same_plan") for r in ok):
        guess += " (other plan)"
    return [run, ",".join(sorted({str(r["used"]) for r in ok})) or "-",
            f"{statistics.median(r['samples_per_s'] for r in ok):.3f}" if ok else "failed", per_round, guess,
            f"{peak[0] / 2**20:.0f} MiB ({peak[1]})" if peak else "-",
            f"{held[0] / 2**20:.0f} MiB ({held[1]})" if held else "-",
            f"{statistics.median(r['wall_s'] for r in rounds):.0f} s"]


def table(rows: list[list[str]]) -> str:
    head = ["run", "devices", "samples/s", "per round", "predicted", "peak memory (device)", "resident", "wall"]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *rows])


def header(args: argparse.Namespace) -> str:
    cpus = [float(c) for c in args.cpu.split(",")]
    cores = sum(cpus) if len(cpus) > 1 else cpus[0] * args.devices
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; testbed: {args.devices} devices, "
            f"cpu {args.cpu} ({cores:g} cores in all), mem {args.mem}, bandwidth {args.bandwidth}; {args.model} at {args.img_size}, "
            f"batch {args.batch_size} in {args.microbatches} micro-batches, {args.steps} steps, {args.repeat} rounds")


def against(results: dict[str, list[dict]]) -> list[str]:
    """Each run's rate over `alone`'s (the share of what the devices compute when nothing is
    exchanged) and over `ddp`'s, where those ran: the ratio of the medians, and each round's,
    whose runs ran next to each other."""
    def rate(r: dict) -> float | None:
        return None if "error" in r else r["samples_per_s"]

    lines = []
    for base in ("alone", "ddp"):
        if base not in results or not any(rate(r) for r in results[base]):
            continue
        base_median = statistics.median(rate(r) for r in results[base] if rate(r))
        parts = []
        for run, rounds in results.items():
            ok = [rate(r) for r in rounds if rate(r)]
            if run == base or not ok:
                continue
            each = ", ".join(f"{rate(r) / rate(b):.2f}" if rate(r) and rate(b) else "-"
                             for r, b in zip(rounds, results[base]))
            parts.append(f"{run} {statistics.median(ok) / base_median:.2f}x ({each})")
        if parts:
            lines.append(f"against {base} (medians; each round): " + "; ".join(parts))
    return lines


def failures(results: dict[str, list[dict]]) -> list[str]:
    return [f"{r['label']}: {r['error']}" for rounds in results.values() for r in rounds if "error" in r]


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0:
        sys.exit("versus.py: the namespace testbed needs root")
    bench = load_swarm_bench()
    bench.TESTBED[:] = ["--devices", args.devices, "--cpu", args.cpu, "--mem", args.mem, "--bandwidth", args.bandwidth]
    started = header(args)
    print(started, file=sys.stderr, flush=True)
    results: dict[str, list[dict]] = {run: [] for run in args.runs}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.repeat):
                for run in args.runs if k % 2 == 0 else args.runs[::-1]:
                    results[run].append(measure(bench, run, args, Path(tmp), f"{run}-{k + 1}"))
                    progress(results[run][-1])
    finally:
        bench.swarm("testbed", "down", check=False)
    print(started)
    print(table([summarise(run, rounds) for run, rounds in results.items()]))
    for line in against(results):
        print(line)
    for line in failures(results):
        print(f"  {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
