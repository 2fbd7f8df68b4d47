"""A classroom of agents on loopback: how soon `swarm status` lists them all, what an idle agent holds,
and what a coordinator holding them all costs at rest.

    PYTHONPATH=. python bench/classroom_agents.py [--agents 8,16,32,64] [--seconds 20]

For each count N it starts N `swarm join --interface lo --port 0` processes at once (each its
own state directory, a fresh strong token in SWARM_TOKEN, no --peers: they advertise on mDNS
on lo), waits until every one logs that it listens, and then measures:

  status    the real CLI, as a user runs it, with the devices it lists as alive:
            `swarm status --interface lo --expect N --wait 30` (found by mDNS on lo), timed
            from the moment the last agent was ready to the moment the command exits; then,
            each timed from its own start, the same with `--no-mdns --peers` naming all N
            (no mDNS), and plain `swarm status --interface lo` (its default 2 s look);
  memory    each idle agent's RSS and USS (psutil), and whether torch is mapped into it
            (a libtorch shared object in /proc/PID/maps: what importing torch would leave);
  at rest   a coordinator in this process holding all N (open_roster with mDNS on lo and
            --peers, and the heartbeat interval, suspect and probe settings a training
            coordinator uses, SwarmOptions in swarm/execution/launch.py): its CPU time over
            --seconds as % of one core (every thread, and its event loop's thread alone),
            its RSS, and the agents' mean CPU over the same window
            (/proc/PID/task/TID/schedstat).

Every agent is stopped (SIGTERM, then SIGKILL) before the next count, and at exit.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heartbeat_cpu import cpu_between, thread_cpu  # noqa: E402 - bench/ is not a package

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"listening on 127\.0\.0\.1 port (\d+)")
READY_TIMEOUT = 600.0
STATUS_WAIT = 30.0


@dataclass
class Agent:
    name: str
    process: subprocess.Popen
    log: Path
    port: int | None = None
    ready_at: float | None = None   # time.perf_counter() when its ready line was seen


@dataclass
class Classroom:
    """What one count of agents measured (times in seconds, memory in bytes, CPU as fractions of a core)."""
    agents: int
    launch_to_ready: float = 0.0
    status: dict[str, tuple[float, int]] = field(default_factory=dict)   # way -> (seconds, alive listed)
    rss: list[int] = field(default_factory=list)
    uss: list[int] = field(default_factory=list)
    with_torch: int = 0
    coordinator_cpu: float = 0.0
    coordinator_loop_cpu: float = 0.0   # its event loop's thread alone (the rest: zeroconf's threads)
    coordinator_rss: int = 0
    agent_cpu: float = 0.0
    events: list[str] = field(default_factory=list)  # membership events other than "joined" while at rest


def environment(token: str) -> dict[str, str]:
    """The agents' and the CLI's environment: this swarm, the token, discovery pinned to lo, and none
    of the caller's swarm settings (a `swarm` picks its allocator itself)."""
    from swarm.host import malloc

    env = {k: v for k, v in malloc.without_own_preload(dict(os.environ)).items()
           if not k.startswith("SWARM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(SWARM_TOKEN=token, SWARM_INTERFACE="lo")
    return env


def start_agents(count: int, directory: Path, env: dict[str, str]) -> list[Agent]:
    agents = []
    for k in range(count):
        name = f"pupil{k}"
        log = directory / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "swarm", "join", "--name", name, "--interface", "lo", "--port", "0",
                 "--state-dir", str(directory / name), "--config", os.devnull],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        agents.append(Agent(name, process, log))
    return agents


def wait_ready(agents: list[Agent]) -> None:
    """Until every agent has logged that it listens; RuntimeError with its log's tail if one exits."""
    deadline = time.perf_counter() + READY_TIMEOUT
    waiting = list(agents)
    while waiting:
        for agent in list(waiting):
            text = agent.log.read_text(errors="replace")
            if match := READY.search(text):
                agent.port, agent.ready_at = int(match.group(1)), time.perf_counter()
                waiting.remove(agent)
            elif agent.process.poll() is not None:
                raise RuntimeError(f"{agent.name} exited while starting:\n" + "\n".join(text.splitlines()[-5:]))
        if waiting and time.perf_counter() > deadline:
            raise RuntimeError(f"{len(waiting)} agents not ready within {READY_TIMEOUT:g} s")
        time.sleep(0.05)


def stop_agents(agents: list[Agent]) -> None:
    """SIGTERM (a clean goodbye on mDNS), then SIGKILL whoever is still there after 15 s."""
    for agent in agents:
        if agent.process.poll() is None:
            agent.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for agent in agents:
        try:
            agent.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()


def run_status(args: list[str], env: dict[str, str], since: float) -> tuple[float, int]:
    """`swarm status --json ARGS`: (seconds from `since` to its exit, devices it lists as alive)."""
    done = subprocess.run([sys.executable, "-m", "swarm", "status", "--json", *args], env=env,
                          capture_output=True, text=True, timeout=STATUS_WAIT + 60)
    elapsed = time.perf_counter() - since
    if done.returncode != 0:
        raise RuntimeError(f"swarm status {' '.join(args)} failed:\n{done.stderr}")
    return elapsed, sum(d["health"] == "alive" for d in json.loads(done.stdout))


def libtorch_mapped(pid: int) -> bool:
    """Is a libtorch shared object mapped into the process (as importing torch leaves it)?"""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def coordinator_at_rest(agents: list[Agent], token: str, seconds: float, result: Classroom) -> None:
    """A coordinator with a training run's membership settings holds every agent; CPU over `seconds`."""
    from swarm.cluster import open_roster
    from swarm.execution.launch import SwarmOptions
    from swarm.net import Credentials, resolve_network

    options = SwarmOptions()
    peers = [("127.0.0.1", a.port) for a in agents]
    pids = [a.process.pid for a in agents]
    async with open_roster(Credentials("bench-coordinator", token), resolve_network("lo"), peers=peers,
                            heartbeat_interval=options.heartbeat_s, suspect_after=options.suspect_after_s,
                            probe_timeout=options.probe_timeout_s) as roster:
        devices = await roster.wait_for(len(agents), timeout=60)
        if len(devices) != len(agents):
            raise RuntimeError(f"the coordinator holds {len(devices)} of {len(agents)} agents")
        await trio.sleep(2.0)  # the connections' first exchanges are over
        settled = len(roster.membership.log)
        c0, l0, a0, t0 = own_cpu(), thread_cpu([os.getpid()])[0], thread_cpu(pids), time.perf_counter()
        await trio.sleep(seconds)
        c1, l1, a1, t1 = own_cpu(), thread_cpu([os.getpid()])[0], thread_cpu(pids), time.perf_counter()
        result.coordinator_cpu = (c1 - c0) / (t1 - t0)
        loop = threading.get_native_id()  # trio runs in this thread
        result.coordinator_loop_cpu = (l1[loop] - l0[loop]) / (t1 - t0)
        result.agent_cpu = statistics.mean(cpu_between(a0, a1)) / (t1 - t0)
        result.coordinator_rss = psutil.Process().memory_info().rss
        result.events = [f"{e.node_id} {e.kind} ({e.reason})" for e in roster.membership.log[settled:]]


def classroom(count: int, seconds: float) -> Classroom:
    from swarm.host.state import new_token

    result = Classroom(count)
    directory = Path(tempfile.mkdtemp(prefix="swarm-classroom-"))
    token = new_token()
    env = environment(token)
    cli_env = dict(env, SWARM_STATE_DIR=str(directory / "cli"))
    agents: list[Agent] = []
    try:
        launched = time.perf_counter()
        agents = start_agents(count, directory, env)
        wait_ready(agents)
        last = max(a.ready_at for a in agents)
        result.launch_to_ready = last - launched
        result.status["mdns"] = run_status(["--expect", str(count), "--wait", str(STATUS_WAIT)], cli_env, last)
        t = time.perf_counter()
        peers = ",".join(f"127.0.0.1:{a.port}" for a in agents)
        result.status["peers"] = run_status(["--no-mdns", "--peers", peers, "--expect", str(count),
                                             "--wait", str(STATUS_WAIT)], cli_env, t)
        t = time.perf_counter()
        result.status["default"] = run_status([], cli_env, t)
        for agent in agents:
            info = psutil.Process(agent.process.pid).memory_full_info()
            result.rss.append(info.rss)
            result.uss.append(info.uss)
            result.with_torch += libtorch_mapped(agent.process.pid)
        trio.run(coordinator_at_rest, agents, token, seconds, result)
    finally:
        stop_agents(agents)
        shutil.rmtree(directory, ignore_errors=True)
    return result


def table(results: list[Classroom]) -> str:
    mib = 2 ** 20
    rows = [("agents", "all ready", "status mDNS", "status --peers", "status (2 s)", "agent RSS med/max",
             "agent USS med", "torch", "coord. CPU (loop)", "coord. RSS", "agent CPU")]
    for r in results:
        def status(way: str) -> str:
            seconds, alive = r.status[way]
            return f"{seconds:.2f} s ({alive})"
        rows.append((str(r.agents), f"{r.launch_to_ready:.1f} s", status("mdns"), status("peers"), status("default"),
                     f"{statistics.median(r.rss) / mib:.0f}/{max(r.rss) / mib:.0f} MiB",
                     f"{statistics.median(r.uss) / mib:.0f} MiB", f"{r.with_torch}/{r.agents}",
                     f"{100 * r.coordinator_cpu:.2f} % ({100 * r.coordinator_loop_cpu:.2f} %)", f"{r.coordinator_rss / mib:.0f} MiB",
                     f"{100 * r.agent_cpu:.2f} %"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="8,16,32,64", help="comma list of agent counts (default: 8,16,32,64)")
    parser.add_argument("--seconds", type=float, default=20.0, help="the coordinator's window at rest (default: 20)")
    args = parser.parse_args()
    counts = [int(n) for n in args.agents.split(",")]
    load = os.getloadavg()[0]

    results = []
    for count in counts:
        result = classroom(count, args.seconds)
        results.append(result)
        for event in result.events:
            print(f"{count} agents, at rest: {event}", file=sys.stderr)
        print(f"{count} agents done", file=sys.stderr, flush=True)
    print(f"PYTHONPATH=. python bench/classroom_agents.py --agents {args.agents} --seconds {args.seconds:g}"
          f"  (load average at the start: {load:.1f})")
    print("status: seconds to the command's exit (devices it listed alive), the mDNS one from the moment the "
          "last agent was ready, the others from their own start; CPU: % of one core")
    print(table(results))


if __name__ == "__main__":
    main()
