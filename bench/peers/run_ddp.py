"""Start a peer (bench/peers/ddp.py or pipe.py) on the namespace testbed: a torchrun node in each device's namespace and cgroups.

    result = run_ddp(6, ["--model", "yolov2-16", "--batch-size", "32", "--steps", "4"], Path("ddp.jsonl"),
                     Path("logs"), timeout=1800)
    result = run_peer(PIPE, 8, [...], Path("pipe.jsonl"), Path("logs"), timeout=1800)

Device k runs, all devices at once (root, a testbed up):

    swarm testbed exec --in-cgroup devK -- python -m torch.distributed.run --nnodes N --node-rank K
        --nproc-per-node 1 --master-addr 10.213.77.10 --master-port 29500 bench/peers/ddp.py ... --metrics FILE

with GLOO_SOCKET_IFNAME=swarm0 and OMP_NUM_THREADS=1. The result is {"steps": [rank 0's metrics]}
or {"error": one line}: "out of memory on devK ..." when a device's memory limit killed a
process, "timed out after S s", or the failing node's last error line.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from swarm.testbed import testbed
from swarm.testbed.names import DEVICE_INTERFACE, device_address, device_name

ROOT = Path(__file__).resolve().parents[2]
DDP = Path(__file__).with_name("ddp.py")
PIPE = Path(__file__).with_name("pipe.py")
MASTER_PORT = 29500
FAILURE_GRACE_S = 30.0  # after one node fails, how long the others get to notice before they are stopped
STOP_GRACE_S = 15.0  # after SIGTERM, how long torchrun gets to stop its worker before SIGKILL
ERROR_LINE = re.compile(r"^((\w+\.)*\w*(Error|Exception): |swarm \w+: error: )")
KILLED = re.compile(r"Killed process \d+ \((.*?)\).*?anon-rss:(\d+)kB")


def node_command(k: int, n: int, ddp_args: list, script: Path = DDP) -> list[str]:
    """The command that starts node k of n on device k."""
    return [sys.executable, "-m", "swarm", "testbed", "exec", "--in-cgroup", device_name(k), "--",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--node-rank", str(k),
            "--nproc-per-node", "1", "--master-addr", device_address(0), "--master-port", str(MASTER_PORT),
            str(script), *map(str, ddp_args)]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": DEVICE_INTERFACE, "OMP_NUM_THREADS": "1"}


def start_nodes(n: int, ddp_args: list, logs: Path, script: Path = DDP) -> list[subprocess.Popen]:
    logs.mkdir(parents=True, exist_ok=True)
    nodes = []
    for k in range(n):
        with open(logs / f"{script.stem}-{device_name(k)}.log", "w") as log:
            nodes.append(subprocess.Popen(node_command(k, n, ddp_args, script), stdout=log, stderr=subprocess.STDOUT,
                                          env=environment(), start_new_session=True))
    return nodes


def wait_nodes(nodes: list[subprocess.Popen], timeout: float) -> tuple[int | None, bool]:
    """Wait for every node; (the index of the first to fail or None, whether time ran out).
    Once one fails, or time runs out, the others are stopped."""
    deadline = time.monotonic() + timeout
    first_failed = None
    while any(p.poll() is None for p in nodes):
        if first_failed is None:
            first_failed = next((k for k, p in enumerate(nodes) if p.poll()), None)
            if first_failed is not None:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if time.monotonic() > deadline:
            stop(nodes)
            return first_failed, first_failed is None
        time.sleep(0.5)
    if first_failed is None:
        first_failed = next((k for k, p in enumerate(nodes) if p.returncode), None)
    return first_failed, False


def stop(nodes: list[subprocess.Popen]) -> None:
    """SIGTERM each torchrun still running (it stops its worker), then SIGKILL what is left of them."""
    running = [p for p in nodes if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def oom_kills(cgroup_dirs: list[str]) -> int:
    """How many processes the cgroup's memory limit has killed (cgroup v2 or v1)."""
    for d in cgroup_dirs:
        for name in ("memory.events", "memory.oom_control"):
            try:
                text = (Path(d) / name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0


def out_of_memory() -> str | None:
    """"out of memory on devK (limit ...): what was killed", or None when no limit killed anything."""
    record = testbed.load()
    hit = [d for d in (record.devices if record else []) if oom_kills(d.cgroups)]
    if not hit:
        return None
    limits = ", ".join(f"{d.name} (limit {d.memory / 2**30:.2g} GiB)" if d.memory else d.name for d in hit)
    return f"out of memory on {limits}: {killed_processes() or 'see dmesg'}"


def killed_processes() -> str:
    """The kernel's last few "Killed process" lines, briefly: name and resident size."""
    r = subprocess.run(["dmesg"], capture_output=True, text=True)
    found = [m for m in map(KILLED.search, r.stdout.splitlines()) if m][-3:]
    return "; ".join(f"killed {m[1]} at {int(m[2]) / 1024:.0f} MiB resident" for m in found)


def last_error(output: str) -> str:
    """The last error a program printed: an exception (not torchrun's wrapper of the worker's)
    or a "swarm CMD: error:" line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line) and "ChildFailedError" not in line]
    return (errors or lines or ["no output"])[-1]


def run_ddp(n: int, ddp_args: list, metrics: Path, logs: Path, timeout: float) -> dict:
    """Train with ddp.py over devices dev0..dev(n-1); rank 0's metrics, or the error."""
    return run_peer(DDP, n, ddp_args, metrics, logs, timeout)


def run_peer(script: Path, n: int, ddp_args: list, metrics: Path, logs: Path, timeout: float) -> dict:
    """Train with a peer script over devices dev0..dev(n-1); rank 0's metrics, or the error."""
    nodes = start_nodes(n, [*ddp_args, "--metrics", metrics], logs, script)
    failed, timed_out = wait_nodes(nodes, timeout)
    oom = out_of_memory()
    if oom:
        return {"error": oom}
    if timed_out:
        return {"error": f"timed out after {timeout:g} s"}
    if failed is not None:
        log = logs / f"{script.stem}-{device_name(failed)}.log"
        return {"error": f"{device_name(failed)}: {last_error(log.read_text(errors='replace'))}"}
    return {"steps": [json.loads(line) for line in metrics.read_text().splitlines()]}
