"""What swarm's own ring all-reduce of yolov2-16's gradients costs each testbed device (root).

    sudo python bench/ring_swarm.py [--devices 8] [--cpu 0.2] [--bandwidth 100mbit]
                                    [--repeats 5] [--algorithms direct,hd,ring] [--rounds 2]

The same measurement as bench/ring_floor.py, through swarm's stack instead of bare sockets:
each device, in its namespace and CPU cgroup, opens authenticated connections to the
devices it sends to (serve_peers, RunLinks with connect_peer: sealed frames), behind the
endpoint training uses (swarm.execution.train_job.WireEndpoint, JobData messages), and sums yolov2-16's five
gradient buckets (the sizes GradReducer makes, the top one first, all under way at once)
with swarm.execution.collectives.allreduce_sum (or, with --algorithms, each way it has in
turn, each on a fresh set of connections). It prints, as medians over the devices of
each one's median over --repeats (the first is left out: connections warm up), the process
CPU seconds and the wall seconds of the five all-reduces, next to ring_floor's bare ring.

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
from testbed_group import group_endpoint, run_on_devices  # noqa: E402 - bench/ is not a package

PORT = 4762
TOKEN = "ring-bench-token-0123456789abcdef"
# yolov2-16's gradient buckets in bytes (planner.buckets.buckets_of), in backward order
BUCKETS = (5300424, 5249024, 1181696, 1313792, 703104)
BUCKET_LAYERS = (16, 13, 10, 9, 6)  # each bucket's name: its top layer (the key the send order reads)


def ring_child(me: int, addresses: list[str], repeats: int, algorithm: str) -> None:
    import torch
    import trio

    from swarm.execution import collectives

    torch.set_num_threads(1)
    allreduce_sum = {"": collectives.allreduce_sum, "direct": collectives._direct, "hd": collectives._halving_doubling,
                     "ring": collectives._ring}[algorithm]
    n = len(addresses)

    async def main() -> None:
        async with group_endpoint(me, addresses, PORT, TOKEN, "ring") as (ep, names):
            async def all_at_once(r: int, grads: list) -> None:
                async with trio.open_nursery() as ring:
                    for b, flat in enumerate(grads):
                        ring.start_soon(allreduce_sum, ep, names, ("grads", r, 0, BUCKET_LAYERS[b]), flat, 60.0)
            result = await timed_sums(me, n, repeats, all_at_once)
        print(json.dumps(result), flush=True)

    if os.environ.get("RING_PROFILE") == str(me):  # CPU time by function, for one device
        import cProfile
        profile = cProfile.Profile(time.process_time)
        profile.runcall(trio.run, main)
        profile.dump_stats(f"/tmp/ring_swarm_{me}.prof")
    else:
        trio.run(main)


async def timed_sums(me: int, n: int, repeats: int, sum_buckets) -> dict:
    """`await sum_buckets(r, grads)` for r = 0..repeats, each over fresh BUCKETS of member
    `me`'s value (checked after); the medians of the CPU, system and wall seconds each took,
    the first left out."""
    import torch

    cpu, wall, system = [], [], []
    for r in range(repeats + 1):
        grads = [torch.full((size // 4,), float(me + 1)) for size in BUCKETS]
        c0, t0, s0 = time.process_time(), time.monotonic(), os.times().system
        await sum_buckets(r, grads)
        if r:
            cpu.append(time.process_time() - c0)
            wall.append(time.monotonic() - t0)
            system.append(os.times().system - s0)
        want = n * (n + 1) / 2
        assert all(bool((g == want).all()) for g in grads), "wrong sum"
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall), "cpus": cpu,
            "system_s": statistics.median(system)}


def measure(n: int, args, algorithm: str = "") -> dict:
    results = run_on_devices(__file__, n, args.cpu, args.bandwidth, [str(args.repeats), algorithm])
    return {"devices": n, "cpu_s": statistics.median(r["cpu_s"] for r in results),
            "cpu_s_range": [min(r["cpu_s"] for r in results), max(r["cpu_s"] for r in results)],
            "wall_s": statistics.median(r["wall_s"] for r in results),
            "system_s": statistics.median(r["system_s"] for r in results)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        me, addresses, repeats, algorithm = sys.argv[2:6]
        ring_child(int(me), addresses.split(","), int(repeats), algorithm)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="8")
    p.add_argument("--cpu", default="0.2")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--algorithms", default="", help="all-reduce ways to alternate, comma-separated: direct "
                   "(straight to each chunk's owner), hd (halving and doubling), ring; default: what swarm picks")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    mbytes = sum(BUCKETS) / 1e6
    print(f"swarm all-reduce of {mbytes:.2f} MB in {len(BUCKETS)} buckets over testbed devices "
          f"({args.cpu} core, {args.bandwidth} each)")
    print(f"{'devices':>8} {'algorithm':>9} {'CPU s':>7} {'(range)':>13} {'system':>7} {'wall s':>7} {'MB out/in':>10}")
    for _ in range(args.rounds):
        for n in (int(x) for x in args.devices.split(",")):
            for algorithm in args.algorithms.split(","):
                r = measure(n, args, algorithm)
                moved = 2 * (n - 1) / n * mbytes
                print(f"{n:>8} {algorithm or '-':>9} {r['cpu_s']:7.3f} {r['cpu_s_range'][0]:6.3f}-"
                      f"{r['cpu_s_range'][1]:.3f} {r['system_s']:7.3f} {r['wall_s']:7.2f} {moved:10.1f}", flush=True)


if __name__ == "__main__":
    main()
