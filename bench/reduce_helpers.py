"""Would idle devices speed up the replicas' gradient sums by owning chunks of them? (root)

    sudo python bench/reduce_helpers.py [--rounds 2] [--repeats 4] [--helper-shares 0.3,0.2]

On the mixed swarm (six devices of 0.1, 0.1, 0.2, 0.2, 0.4 and 0.6 core, 1 GiB, 100 Mbit),
`auto` trains yolov4-tiny at 416 on replicas of the four fastest devices, whose sums of
24.2 MB move 36 MB each way a step on every replica's link while the two 0.1-core
devices' links stay idle. Each device here, in its namespace and CPU cgroup, over the
endpoint training uses (bench/testbed_group.py), sums yolov4-tiny's seven gradient buckets
(planner.buckets.buckets_of's, all under way at once) among the four replicas (dev2-dev5),
in turns:
  - straight to each replica's chunk (swarm.execution.collectives._direct, what training does);
  - with the two idle devices owning a share H each of every bucket and the replicas the rest
    evenly: each replica sends each owner its chunk, each owner sums the replicas' chunks in
    replica order and sends the sum to every replica. At H = 0.3 each replica moves 1.2 times
    the bucket each way instead of 1.5.
It prints, per way, every device's median wall and CPU seconds over --repeats (the first
is left out: connections warm up).

With a testbed already up, it runs on its first six devices and leaves it up; otherwise it
brings the mixed swarm up and down.
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

PORT = 4763
TOKEN = "helpers-bench-token-0123456789abcdef"
CPU = "0.1,0.1,0.2,0.2,0.4,0.6"
# yolov4-tiny's gradient buckets in bytes (planner.buckets.buckets_of), in backward order, by top layer
BUCKETS = (3803132, 5378044, 9967616, 1445888, 2361344, 1192448, 77952)
BUCKET_LAYERS = (36, 32, 27, 23, 18, 15, 1)
REPLICAS = (5, 4, 3, 2)  # device indices, in summing order
HELPERS = (0, 1)


def child(me: int, addresses: list[str], repeats: int, helper_share: float) -> None:
    import torch
    import trio

    from swarm.execution import channels
    from swarm.execution.collectives import _direct

    torch.set_num_threads(1)
    if helper_share:
        owners = [*HELPERS, *REPLICAS]
        shares = [helper_share] * len(HELPERS) + [(1 - len(HELPERS) * helper_share) / len(REPLICAS)] * len(REPLICAS)
    else:
        owners, shares = list(REPLICAS), [1 / len(REPLICAS)] * len(REPLICAS)

    def chunk_bounds(n: int) -> list[int]:
        edges = [0.0]
        for s in shares:
            edges.append(edges[-1] + s)
        return [round(e * n) for e in edges]

    async def own(ep, names, key, j: int, mine: torch.Tensor | None, send) -> torch.Tensor:
        total = None
        for src, r in enumerate(REPLICAS):
            part = mine.clone() if r == me else (await ep.mailbox.get(channels.ring(key, "ds", j, src), 60))["arrays"][0]
            total = part if total is None else total.add_(part)
        for r in REPLICAS:
            if r != me:
                send(ep.send, names[r], channels.ring(key, "dg", j, j), {"arrays": [total]})
        return total

    async def replica(ep, names, key, flat: torch.Tensor) -> None:
        b = chunk_bounds(flat.numel())
        chunks = [flat[b[i]:b[i + 1]] for i in range(len(owners))]
        async with trio.open_nursery() as nursery:
            for j, o in enumerate(owners):
                if o != me:
                    nursery.start_soon(ep.send, names[o], channels.ring(key, "ds", j, REPLICAS.index(me)),
                                       {"arrays": [chunks[j]]})
            if me in owners:
                j = owners.index(me)
                chunks[j].copy_(await own(ep, names, key, j, chunks[j], nursery.start_soon))
            for j, o in enumerate(owners):
                if o != me:
                    chunks[j].copy_((await ep.mailbox.get(channels.ring(key, "dg", j, j), 60))["arrays"][0])

    async def helper(ep, names, key) -> None:
        async with trio.open_nursery() as nursery:
            await own(ep, names, key, owners.index(me), None, nursery.start_soon)

    async def main() -> None:
        async with group_endpoint(me, addresses, PORT, TOKEN, "helpers") as (ep, names):
            group = [names[r] for r in REPLICAS]
            cpu, wall = [], []
            for rep in range(repeats + 1):
                await trio.sleep(1.0)  # every device ready for the round
                c0, t0 = time.process_time(), time.monotonic()
                async with trio.open_nursery() as nursery:
                    for b, size in enumerate(BUCKETS):
                        key = ("grads", rep, 0, BUCKET_LAYERS[b])
                        if me in REPLICAS:
                            flat = torch.full((size // 4,), float(me + 1))
                            if helper_share:
                                nursery.start_soon(replica, ep, names, key, flat)
                            else:
                                nursery.start_soon(_direct, ep, group, key, flat, 60.0)
                        elif helper_share:
                            nursery.start_soon(helper, ep, names, key)
                if rep:
                    cpu.append(time.process_time() - c0)
                    wall.append(time.monotonic() - t0)
            await trio.sleep(2.0)
        print(json.dumps({"device": me, "cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}), flush=True)

    trio.run(main)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        me, addresses, repeats, helper_share = sys.argv[2:6]
        child(int(me), addresses.split(","), int(repeats), float(helper_share))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--helper-shares", default="0.3,0.2", help="each idle device's share of every bucket, one way "
                   "per value, alternated with the replicas summing alone")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("the namespace testbed needs root")
    ways = [0.0] + [float(s) for s in args.helper_shares.split(",")]
    print(f"yolov4-tiny's sums ({sum(BUCKETS) / 1e6:.1f} MB in {len(BUCKETS)} buckets) over replicas dev5, dev4, "
          f"dev3, dev2 (cpu {CPU}, 100mbit); median wall s / CPU s of each device")
    for _ in range(args.rounds):
        for share in ways:
            results = run_on_devices(__file__, 6, CPU, "100mbit", [str(args.repeats), str(share)])
            way = f"helpers own {share:.2f} each" if share else "replicas alone"
            print(f"{way:>22}: " + " ".join(f"dev{r['device']} {r['wall_s']:.2f}/{r['cpu_s']:.2f}"
                                            for r in sorted(results, key=lambda r: r["device"])), flush=True)


if __name__ == "__main__":
    main()
