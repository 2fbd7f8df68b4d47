"""What summing yolov2-16's gradients on swarm's gradient-sum lanes costs each testbed device (root).

    sudo python bench/ring_lane.py [--devices 8] [--cpu 0.2] [--bandwidth 100mbit] [--repeats 5]

The same measurement as bench/ring_swarm.py, through the lanes runs sum on
(swarm/execution/lane.py) instead of the event loop: each device, in its namespace and CPU
cgroup, opens a lane to every other (connect_peer and its hello, as JobContext.open_lane does;
serve_peers hands the others' to it, as an agent does) and sums yolov2-16's five gradient
buckets (ring_swarm.BUCKETS) with SumLanes.allreduce, top layer first, one after another, as
GradReducer hands them over.

It prints the same columns as bench/ring_swarm.py and bench/ring_floor.py: medians over the
devices of each one's median over --repeats (the first is left out), CPU-s a sum, of them the
system's, and wall seconds. With a testbed already up (`swarm testbed up`), it runs on that
one and leaves it up; otherwise it brings one up and down.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ring_swarm import BUCKET_LAYERS, BUCKETS, timed_sums  # noqa: E402 - bench/ is not a package
from testbed_group import run_on_devices  # noqa: E402

PORT = 4763
TOKEN = "lane-bench-token-0123456789abcdef"
JOB = "lane-bench"


def lane_child(me: int, addresses: list[str], repeats: int) -> None:
    import torch
    import trio

    from swarm.execution.lane import LANE, SumLanes
    from swarm.net import Credentials, connect_peer, serve_peers
    from swarm.wire import JobData

    torch.set_num_threads(1)
    n = len(addresses)
    names = [f"dev{k}" for k in range(n)]
    creds = Credentials(f"{JOB}-node-{me}", TOKEN)
    devices = {names[k]: {"node_id": f"{JOB}-node-{k}", "address": f"{addresses[k]}:{PORT}"} for k in range(n)}
    offered, offers = trio.open_memory_channel(math.inf)

    async def handler(conn) -> None:  # what an agent does with a lane's hello
        message = await conn.receive()
        if isinstance(message, JobData) and message.channel == LANE:
            offered.send_nowait((conn.peer_id, (message.body, conn)))
            await conn.wait_released()

    async def open_lane(address: str, node_id: str, body: dict):
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + 30
        while True:  # the other device may not listen yet
            try:
                conn = await connect_peer(host, int(port), creds, expected_peer_id=node_id)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await trio.sleep(0.1)
        await conn.send(JobData(JOB, 0, LANE, body))
        return conn

    async def report(name: str, why: str) -> None:
        raise RuntimeError(f"lane to {name} broke: {why}")

    async def main() -> dict:
        lanes = SumLanes(names[me], devices, JOB, 0, open_lane, offers.receive, report)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_peers, handler, creds, [addresses[me]], PORT)
            nursery.start_soon(lanes.pump)
            async def one_after_another(r: int, grads: list) -> None:  # top layer first, as GradReducer
                for b, flat in enumerate(grads):
                    await lanes.allreduce(0, names, ("grads", r, 0, BUCKET_LAYERS[b]), flat, 60.0)
            result = await timed_sums(me, n, repeats, one_after_another)
            await trio.sleep(1.0)  # the others finish with our lanes
            await lanes.aclose()
            nursery.cancel_scope.cancel()
        return result

    print(json.dumps(trio.run(main)), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        me, addresses, repeats = sys.argv[2:5]
        lane_child(int(me), addresses.split(","), int(repeats))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cpu", default="0.2")
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    mbytes = sum(BUCKETS) / 1e6
    print(f"lane all-reduce of {mbytes:.2f} MB in {len(BUCKETS)} buckets over testbed devices "
          f"({args.cpu} core, {args.bandwidth} each)")
    print(f"{'devices':>8} {'CPU s':>7} {'(range)':>13} {'system':>7} {'wall s':>7} {'MB out/in':>10}")
    results = run_on_devices(__file__, args.devices, args.cpu, args.bandwidth, [str(args.repeats)])
    cpu = [r["cpu_s"] for r in results]
    moved = 2 * (args.devices - 1) / args.devices * mbytes
    print(f"{args.devices:>8} {statistics.median(cpu):7.3f} {min(cpu):6.3f}-{max(cpu):.3f} "
          f"{statistics.median(r['system_s'] for r in results):7.3f} "
          f"{statistics.median(r['wall_s'] for r in results):7.2f} {moved:10.1f}", flush=True)


if __name__ == "__main__":
    main()
