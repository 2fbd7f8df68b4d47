"""CPU cost of heartbeats with 8 peers: the coordinator's and each agent's, per second and per heartbeat.

    PYTHONPATH=. python bench/heartbeat_cpu.py [--peers 8] [--seconds 10] [--interval 0.25]

Starts a loopback testbed of 8 agents (separate processes) and a coordinator in this
process connected to all of them by --peers (it does not browse mDNS). It measures CPU
time (user + system) over a window with no heartbeats (Watch 0) and over a window with
heartbeats every --interval, at the coordinator and the agents; the difference is what
the heartbeats cost.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_cpu(pids: list[int]) -> list[dict[int, float]]:
    """CPU seconds of every thread of each process, from /proc/PID/task/TID/schedstat
    (nanoseconds: psutil's 10 ms clock ticks are too coarse for a few ms a second)."""
    out = []
    for pid in pids:
        threads = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                threads[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError):
                pass
        out.append(threads)
    return out


def cpu_between(before: list[dict[int, float]], after: list[dict[int, float]]) -> list[float]:
    """Per process: CPU used between two samples by the threads alive at both (a worker thread
    that exits in between takes its whole history with it)."""
    return [sum(a[t] - b[t] for t in a.keys() & b.keys()) for b, a in zip(before, after)]


async def measure(peers: list[tuple[str, int]], token: str, pids: list[int], seconds: float, interval: float):
    from swarm.cluster import open_roster
    from swarm.net import Credentials, resolve_network
    from swarm.wire import Heartbeat, Watch

    async with open_roster(Credentials("bench-coordinator", token), resolve_network("lo"), peers=peers,
                            discover=False, heartbeat_interval=interval) as cluster:
        devices = await cluster.wait_for(len(peers), timeout=30)
        assert len(devices) == len(peers), f"only {len(devices)} of {len(peers)} agents answered"
        counted = {"heartbeats": 0}
        original = cluster._on_message

        def counting(device, message):
            if isinstance(message, Heartbeat):
                counted["heartbeats"] += 1
            original(device, message)

        cluster._on_message = counting
        windows = {}
        normal = cluster.membership.suspect_after
        for label, watch in (("idle", 0.0), ("heartbeats", interval)):
            # without heartbeats nobody may be suspected (probes would be measured instead)
            cluster.membership.suspect_after = 1e9 if label == "idle" else normal
            for d in devices:
                cluster.membership.heard_from(d.node_id)  # deadlines from the new setting
            for d in devices:
                await cluster.send(d.node_id, Watch(watch))
            await trio.sleep(1.0)  # settle
            counted["heartbeats"] = 0
            c0, a0, t0 = own_cpu(), thread_cpu(pids), time.perf_counter()
            await trio.sleep(seconds)
            c1, a1, t1 = own_cpu(), thread_cpu(pids), time.perf_counter()
            windows[label] = {"wall": t1 - t0, "coordinator": c1 - c0, "agents": cpu_between(a0, a1),
                              "heartbeats": counted["heartbeats"]}
        assert all(e.kind == "joined" for e in cluster.membership.log), cluster.membership.log
        return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.25)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    env = dict(os.environ, SWARM_TESTBED_DIR=str(directory), PYTHONPATH=str(ROOT), SWARM_INTERFACE="lo")
    swarm = [sys.executable, "-m", "swarm"]
    up = subprocess.run(swarm + ["testbed", "up", "--loopback", "--devices", str(args.peers)], env=env,
                        capture_output=True, text=True)
    try:
        if up.returncode != 0:
            sys.exit(up.stderr)
        from swarm.testbed import testbed

        os.environ["SWARM_TESTBED_DIR"] = str(directory)
        record = testbed.load()
        token = Path(record.token_file).read_text().strip()
        peers = [(d.address, d.port) for d in record.devices]
        pids = [d.pid for d in record.devices]
        windows = trio.run(measure, peers, token, pids, args.seconds, args.interval)
    finally:
        subprocess.run(swarm + ["testbed", "down"], env=env, capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)

    idle, beating = windows["idle"], windows["heartbeats"]
    wall = beating["wall"]
    extra_coord = beating["coordinator"] - idle["coordinator"] * beating["wall"] / idle["wall"]
    extra_agents = [b - a * beating["wall"] / idle["wall"] for a, b in zip(idle["agents"], beating["agents"])]
    n = beating["heartbeats"]
    print(f"{args.peers} agents, heartbeat every {args.interval:g} s, {wall:.1f} s windows; "
          f"{n} heartbeats received ({n / wall:.1f}/s)")
    print(f"coordinator CPU: idle {100 * idle['coordinator'] / idle['wall']:.2f} %, "
          f"with heartbeats {100 * beating['coordinator'] / wall:.2f} % "
          f"-> {1e6 * extra_coord / max(n, 1):.0f} us per heartbeat received")
    mean_idle = sum(idle["agents"]) / len(idle["agents"]) / idle["wall"]
    mean_beat = sum(beating["agents"]) / len(beating["agents"]) / wall
    print(f"agent CPU (mean of {args.peers}): idle {100 * mean_idle:.2f} %, with heartbeats {100 * mean_beat:.2f} % "
          f"-> {1e6 * sum(extra_agents) / max(n, 1):.0f} us per heartbeat sent")


if __name__ == "__main__":
    main()
