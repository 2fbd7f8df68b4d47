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
an exchange costs beyond the segment's, of which the event loop's and the other threads'
(the compute thread's asking and waking), and the wall time of a segment and its exchange.
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
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from heartbeat_cpu import cpu_between, thread_cpu  # noqa: E402 - bench/ is not a package
from testbed_group import group_endpoint, run_on_devices  # noqa: E402
PORT = 4763
TOKEN = "bn-exchange-bench-token-0123456789"


def child(me: int, addresses: list[str], gap: str, segment_s: float, exchanges: int, channels: int) -> None:
    import numpy as np
    import torch
    import trio

    from swarm.execution import channels as keys
    from swarm.execution.collectives import allgather
    from swarm.execution.threads import call_in_loop

    torch.set_num_threads(1)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1)
    x = torch.randn(1, 64, 28, 28)
    memory = np.ones((4 << 20) // 8)
    sums = [torch.tensor([1.0], dtype=torch.float64), torch.randn(channels, dtype=torch.float64),
            torch.rand(channels, dtype=torch.float64)]

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
        async with group_endpoint(me, addresses, PORT, TOKEN, "bn") as (ep, names):
            token = trio.lowlevel.current_trio_token()

            def run(first: int, count: int) -> list[float]:
                # A thread torch did not start takes OpenMP's default thread count, whatever the
                # main thread set: alone, forward-only convolutions then run on two threads here
                # and the second spins between them (2.3x the compute thread's CPU in the process).
                torch.set_num_threads(1)
                waits = []
                for i in range(first, first + count):
                    compute(segment_s)
                    t0 = time.perf_counter()
                    got = call_in_loop(allgather, ep, names, keys.bn(0, 0, i, "1", "fwd"), sums, 60.0, token=token)
                    waits.append(time.perf_counter() - t0)
                    assert len(got) == len(names)
                return waits

            await trio.to_thread.run_sync(run, 0, 10)  # connections made and warm
            c0, t0, threads0 = time.process_time(), time.monotonic(), thread_cpu([os.getpid()])
            waits = await trio.to_thread.run_sync(run, 10, exchanges)
            cpu, wall, threads1 = time.process_time() - c0, time.monotonic() - t0, thread_cpu([os.getpid()])
        loop = os.getpid()  # the event loop runs in the main thread, whose id is the process's
        others = cpu_between([{t: c for t, c in threads0[0].items() if t != loop}],
                             [{t: c for t, c in threads1[0].items() if t != loop}])[0]
        if gap != "sleep":  # the segments' CPU is not the exchanges'
            cpu -= segment_s * exchanges
            others -= segment_s * exchanges
        print(json.dumps({"median_s": statistics.median(waits), "mean_s": statistics.fmean(waits),
                          "cpu_s": cpu / exchanges, "wall_s": wall / exchanges,
                          "loop_cpu_s": (threads1[0][loop] - threads0[0][loop]) / exchanges,
                          "others_cpu_s": others / exchanges}), flush=True)

    trio.run(main)


def measure(args, segment_s: float) -> dict:
    results = run_on_devices(__file__, args.devices, args.cpu, args.bandwidth,
                             [args.gap, repr(segment_s), str(args.exchanges), str(args.channels)])
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


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
    print(f"{'segment ms':>10} {'median ms':>10} {'mean ms':>8} {'CPU ms':>7} {'loop ms':>8} {'others ms':>9} "
          f"{'wall ms':>8}")
    for _ in range(args.rounds):
        for ms in (float(x) for x in args.segments_ms.split(",")):
            r = measure(args, ms / 1000)
            print(f"{ms:10g} {r['median_s'] * 1e3:10.1f} {r['mean_s'] * 1e3:8.1f} {r['cpu_s'] * 1e3:7.2f} "
                  f"{r['loop_cpu_s'] * 1e3:8.2f} {r['others_cpu_s'] * 1e3:9.2f} {r['wall_s'] * 1e3:8.1f}", flush=True)


if __name__ == "__main__":
    main()
