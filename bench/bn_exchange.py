"""What a dp gang's BatchNorm exchanges cost on the testbed (root): their wall time and CPU.

    sudo .venv/bin/python bench/bn_exchange.py [--devices 4] [--cpu 0.2] [--bandwidth 100mbit]
        [--segments-ms 0,5] [--gap conv|numpy|sleep] [--exchanges 200] [--channels 64]

A dp stage whose devices split a micro-batch waits, at every BatchNorm layer forward and
backward, for its group's per-channel sums (swarm.execution.group_bn). Here each device, in its
namespace and CPU cgroup, runs what such a stage's compute thread does, and nothing else:
--segments-ms of its own CPU time computing (--gap: 3x3 convolutions of one 28x28 map, or
passes over 4 MiB) or of sleep, then the group's exchange of a count and two float64 arrays of
--channels values through the event loop (swarm.execution.threads.call_in_loop and
collectives.allgather over sealed connections, as DeviceWorker.bn_exchange), --exchanges
times. It prints, per segment length, the median over the devices of each one's median and
mean wall time of an exchange (from the compute thread asking to its answer), the process CPU
an exchange costs beyond the segment's, and the wall time of a segment and its exchange; and
each device's CPU per exchange by thread (the event loop is the process's first thread).
The profile's message cost (swarm.profiling.bandwidth: msg_cpu_s) is measured the same way,
with passes over memory between round trips.

With a testbed already up (`swarm testbed up`), it runs on that one and leaves it up;
otherwise it brings one up and down.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PORT = 4763
TOKEN = "bn-exchange-bench-token-0123456789"


def child(me: int, addresses: list[str], gap: str, segment_s: float, exchanges: int, channels: int) -> None:
    import numpy as np
    import torch
    import trio

    from swarm.execution import channels as keys
    from swarm.execution.collectives import allgather
    from swarm.execution.channels import send_priority
    from swarm.execution.links import RunLinks
    from swarm.execution.threads import call_in_loop
    from swarm.execution.train_job import WireEndpoint
    from swarm.net import Credentials, connect_peer, serve_peers
    from swarm.wire import JobData

    torch.set_num_threads(1)
    n = len(addresses)
    names = [f"dev{k}" for k in range(n)]
    creds = Credentials(f"bn-node-{me}", TOKEN)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1)
    x = torch.randn(1, 64, 28, 28)
    memory = np.ones((4 << 20) // 8)

    def compute(seconds: float) -> None:
        """`seconds` of this thread's CPU: 3x3 convolutions of one 28x28 map (conv), passes
        over 4 MiB (numpy, as the profile's message bursts do), or a sleep of that long (sleep)."""
        if gap == "sleep":
            time.sleep(seconds)
            return
        end = time.thread_time() + seconds
        with torch.no_grad():
            while time.thread_time() < end:
                if gap == "conv":
                    conv(x)
                else:
                    np.multiply(memory, 1.0, out=memory)

    async def main() -> None:
        devices = {names[k]: {"node_id": f"bn-node-{k}", "address": f"{addresses[k]}:{PORT}"} for k in range(n)}

        async def connect(address: str):
            host, port = address.rsplit(":", 1)
            deadline = time.monotonic() + 30
            while True:  # the other device may not listen yet
                try:
                    return await connect_peer(host, int(port), creds)
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await trio.sleep(0.1)

        async def report(name: str, why: str) -> None:
            raise RuntimeError(f"link to {name} broke: {why}")

        links = RunLinks(devices, connect, report)
        by_node = {d["node_id"]: name for name, d in devices.items()}

        async def send_to(node_id: str, body: dict) -> None:
            await links.send(by_node[node_id], JobData("bn", 0, "x", body), False, send_priority(tuple(body["k"])))

        ep = WireEndpoint(names[me], {name: d["node_id"] for name, d in devices.items()}, send_to)

        async def handler(incoming) -> None:
            async for message in incoming:
                ep.deliver(message.body)

        token = trio.lowlevel.current_trio_token()
        sums = [torch.tensor([1.0], dtype=torch.float64), torch.randn(channels, dtype=torch.float64),
                torch.rand(channels, dtype=torch.float64)]

        def run(first: int, count: int) -> list[float]:
            # A thread torch did not start takes OpenMP's default thread count, whatever the
            # main thread set: alone, forward-only convolutions then run on two threads here and
            # the second spins between them (2.3x the compute thread's CPU in the process).
            torch.set_num_threads(1)
            waits = []
            for i in range(first, first + count):
                compute(segment_s)
                t0 = time.perf_counter()
                got = call_in_loop(allgather, ep, names, keys.bn(0, 0, i, "1", "fwd"), sums, 60.0, token=token)
                waits.append(time.perf_counter() - t0)
                assert len(got) == n
            return waits

        async with trio.open_nursery() as nursery:
            await nursery.start(serve_peers, handler, creds, [addresses[me]], PORT)
            await trio.to_thread.run_sync(run, 0, 10)  # connections made and warm
            c0, t0, threads0 = time.process_time(), time.monotonic(), thread_cpu()
            waits = await trio.to_thread.run_sync(run, 10, exchanges)
            cpu, wall, threads1 = time.process_time() - c0, time.monotonic() - t0, thread_cpu()
            if gap != "sleep":
                cpu -= segment_s * exchanges
            by_thread = sorted(((threads1[k] - threads0.get(k, 0.0), k) for k in threads1), reverse=True)
            await trio.sleep(1.0)  # let the others finish before our connections close
            await links.aclose()
            print(json.dumps({"median_s": statistics.median(waits), "mean_s": statistics.fmean(waits),
                              "cpu_s": cpu / exchanges, "wall_s": wall / exchanges,
                              "threads_s": [(round(t / exchanges, 5), k) for t, k in by_thread[:4]]}), flush=True)
            nursery.cancel_scope.cancel()

    trio.run(main)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process so far, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        out[f"{tid} {name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def swarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm", *args], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def measure(args, segment_s: float) -> dict:
    from swarm.testbed import cgroups, testbed

    try:
        record = testbed.require()
        own = False
    except Exception:
        record, own = None, True
    if own:
        swarm("testbed", "up", "--devices", str(args.devices), "--cpu", args.cpu, "--mem", "1G",
              "--bandwidth", args.bandwidth)
        record = testbed.require()
    try:
        devices = record.devices[:args.devices]
        addresses = [d.address for d in devices]
        children = []
        for k, device in enumerate(devices):
            cmd = ["ip", "netns", "exec", device.namespace, sys.executable, __file__, "--child", str(k),
                   ",".join(addresses), args.gap, repr(segment_s), str(args.exchanges), str(args.channels)]
            c = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            cgroups.add_process([Path(p) for p in device.cgroups], c.pid)  # the device's CPU share
            children.append(c)
        results = [json.loads(c.communicate(timeout=900)[0]) for c in children]
    finally:
        if own:
            swarm("testbed", "down")
    print("  CPU per exchange by thread, each device:", [r["threads_s"] for r in results])
    return {k: statistics.median(r[k] for r in results) for k in results[0] if k != "threads_s"}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        me, addresses, gap, segment, exchanges, channels = sys.argv[2:8]
        child(int(me), addresses.split(","), gap, float(segment), int(exchanges), int(channels))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--cpu", default="0.2")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--segments-ms", default="0,5", help="milliseconds of compute (its CPU time) or of sleep "
                   "before each exchange, comma-separated (default: 0,5)")
    p.add_argument("--gap", choices=("conv", "numpy", "sleep"), default="conv",
                   help="what fills each segment: convolutions, passes over memory, or a sleep (default: conv)")
    p.add_argument("--exchanges", type=int, default=200)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    print(f"group BatchNorm exchanges over {args.devices} testbed devices ({args.cpu} core, {args.bandwidth} each), "
          f"{args.channels} channels, {args.exchanges} exchanges, {args.gap} between")
    print(f"{'segment CPU ms':>14} {'median ms':>10} {'mean ms':>8} {'CPU ms':>7} {'wall ms':>8}")
    for _ in range(args.rounds):
        for ms in (float(x) for x in args.segments_ms.split(",")):
            r = measure(args, ms / 1000)
            print(f"{ms:14g} {r['median_s'] * 1e3:10.1f} {r['mean_s'] * 1e3:8.1f} {r['cpu_s'] * 1e3:7.2f} "
                  f"{r['wall_s'] * 1e3:8.1f}", flush=True)


if __name__ == "__main__":
    main()
