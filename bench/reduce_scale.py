"""A dp group's gradient sums over 16, 32 and 64 devices in one process, measured and set
against the planner's reduction cost.

    PYTHONPATH=. python bench/reduce_scale.py [--model yolov2-16] [--devices 16,32,64]
                                              [--repeats 5] [--rounds 5]

Measured: the wall time of swarm.execution.collectives.allreduce_sum over g endpoints of one
in-memory network (swarm.execution.endpoint.LocalNetwork), summing the model's gradient
buckets (planner.buckets.buckets_of over its float32 parameters, every bucket under way at
once, as GradReducer starts them during the last backward), the median of --repeats after
one left out (it warms the allocator), on the allocator settings the `swarm` command gives
every process (swarm.host.malloc.tune).

Predicted: planner.stage_work.ring_allreduce_time, what the simulator gives a dp stage's
reduction (StageWork.allreduce), for the same bytes, buckets and group, on a Cluster that
describes the process:
- one trio loop and torch on one thread run every device: g devices share one core, each a
  device of 1/g core, whose time per message and per byte is g times its time at full speed
  (as a CPU quota divides it, docs/planner.md "Transfers");
- nothing waits for a wire: latency 0, bandwidth unbounded.

The two full-speed figures are calibrated at 2 devices, two ways, and each gives its own
prediction:
- "profiles": what a live swarm's profiles give the planner. The bandwidth job's figures
  between two agents (swarm.profiling.bandwidth), on the in-memory endpoint: the time per
  message handled (sent or received) from a burst of swaps of a one-element array
  (swarm.profiling.reduction.bare_message_cpu), and the time per byte handled from a burst
  of 1 MiB arrays sent one way, half added into a sum on arrival and half copied into place,
  less their messages' time; and the profile job's figure for a sum's own work per message
  beyond a bare one (swarm.profiling.reduction.reduce_msg_cpu, the device's reduce_msg_s);
- "pairs": the all-reduce's own rounds between two endpoints, with the loop as loaded as the
  group's sum: the g endpoints in g/2 pairs, each pair summing at 2 by halving and doubling
  (the way groups of 16, 32 and 64 sum), every bucket at once. The time per message from sums
  of four floats (two messages out and two in a member), the time per byte from the model's
  buckets less their messages' time. In one process the loop holds every device's sums, and
  a message costs more the more it holds (the garbage collector walks them, the caches hold
  fewer of them): this checks the planner's rounds, messages and bytes at 16-64 on figures
  taken where a message costs what it costs there; "profiles" is what a device with a loop of
  its own measures.
No sum over more than two devices is measured for either prediction.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.cluster import Cluster, Device  # noqa: E402
from planner.costs import CostTable  # noqa: E402
from planner.stage_work import (DIRECT_REDUCE_MAX, allreduce_messages, allreduce_rounds, buckets_of,  # noqa: E402
                                ring_allreduce_time)
from swarm.execution import collectives  # noqa: E402
from swarm.execution.endpoint import LocalNetwork  # noqa: E402
from swarm.host import malloc  # noqa: E402
from swarm.profiling.reduction import bare_message_cpu, reduce_msg_cpu  # noqa: E402

# arrays of 1 MiB (the least bucket) sent one way, 64 MiB in all: more than a cache holds, as a
# group's gradients are
BYTE_BURST, BYTE_ARRAY = 64, 1 << 20
SMALL_SUM_BYTES = 16  # sums of four floats, for a round's time per message


def bucket_bytes(model: str) -> list[int]:
    """The model's gradient buckets in bytes (float32), in the order the backward ends them."""
    from swarm.local.trainer import LocalTrainer, TrainConfig

    desc = LocalTrainer(TrainConfig(model=model, img_size=32, batch_size=1, accelerator="cpu")).desc
    sizes = {i: layer.param_bytes for i, layer in enumerate(desc.layers) if layer.param_bytes > 0}
    return [sum(sizes[i] for i in bucket) for bucket in buckets_of(sizes)]


def calibrate_profiles(repeats: int) -> tuple[float, float, float]:
    """(seconds per message handled, per byte handled, per message of a sum beyond a bare one)
    at full speed: medians over `repeats` bursts between two endpoints of one in-memory network."""
    per_message = statistics.median(bare_message_cpu() for _ in range(repeats))

    def byte_burst() -> float:
        network = LocalNetwork()
        a, b = network.endpoint("a"), network.endpoint("b")
        arrays = [torch.ones(BYTE_ARRAY // 4) for _ in range(BYTE_BURST)]
        into = [torch.ones_like(x) for x in arrays]

        async def send():
            for k, array in enumerate(arrays):
                await a.send("b", ("bytes", k), {"arrays": [array]})

        async def receive():  # half added into a sum (a reduce-scatter's), half copied into place (an all-gather's)
            for k in range(BYTE_BURST):
                got = (await b.mailbox.get(("bytes", k)))["arrays"][0]
                into[k].add_(got) if k % 2 else into[k].copy_(got)

        async def main():  # all sent, then all taken: copies waiting in a mailbox, as a round's do
            t0 = time.perf_counter()
            await send()
            await receive()
            return time.perf_counter() - t0
        seconds = trio.run(main) - 2 * BYTE_BURST * per_message
        return seconds / (2 * BYTE_BURST * BYTE_ARRAY)  # each byte sent and received

    per_byte = statistics.median(byte_burst() for _ in range(repeats))
    return per_message, per_byte, reduce_msg_cpu(repeats)


def pairs_cpu(g: int, sizes: list[int]) -> float:
    """CPU seconds of g endpoints of one in-memory network, in g/2 pairs, each pair summing a
    float32 array of each of `sizes` bytes at 2 by halving and doubling, every sum under way at
    once: the loop holds as many sums as the whole group's would, each between two members."""
    grads = {(i, b): torch.ones(max(1, n // 4)) for i in range(g) for b, n in enumerate(sizes)}
    network = LocalNetwork()
    eps = [network.endpoint(f"d{i}") for i in range(g)]

    async def main():
        await trio.lowlevel.checkpoint()
        cpu0 = time.thread_time()
        async with trio.open_nursery() as nursery:
            for b in range(len(sizes)):
                for i, ep in enumerate(eps):
                    pair = [f"d{i & ~1}", f"d{i | 1}"]
                    nursery.start_soon(collectives._halving_doubling, ep, pair, ("grads", 0, 0, b), grads[i, b],
                                       np.inf)
        return time.thread_time() - cpu0
    return trio.run(main)


def calibrate_pairs(g: int, buckets: list[int], repeats: int) -> tuple[float, float, float]:
    """(seconds per message handled, seconds per byte handled) at full speed, from sums at 2
    with the loop as loaded as the group's sum (pairs_cpu): a sum at 2 is two swaps, two
    messages out and two in per member, and moves 2(g-1)/g = 1 times its bytes out and as
    many in. The messages from sums of four floats, one per bucket."""
    def median(sizes):
        return statistics.median([pairs_cpu(g, sizes) for _ in range(repeats + 1)][1:])
    per_message = median([SMALL_SUM_BYTES] * len(buckets)) / (g * len(buckets) * 2 * 2)
    messages = g * len(buckets) * 2 * 2 * per_message
    per_byte = (median(buckets) - messages) / (g * 2 * sum(buckets))
    return per_message, per_byte, 0.0  # the sum's own work is in both figures


def in_process_cluster(g: int, per_message: float, per_byte: float, reduce_message: float) -> Cluster:
    """g devices sharing one core, with no wire between them (see the module docstring)."""
    idle = CostTable((1,), np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1))
    devices = [Device(f"d{i}", idle, memory=2**40, comm_s_per_byte=g * per_byte, msg_s=g * per_message,
                      reduce_msg_s=g * reduce_message) for i in range(g)]
    return Cluster(devices, np.full((g, g), np.inf), latency=0.0, name=f"{g} devices in one process")


def measure(g: int, buckets: list[int], repeats: int) -> float:
    """Median wall seconds of every bucket's all-reduce over g in-process endpoints."""
    names = [f"d{i}" for i in range(g)]
    grads = {(i, b): torch.randn(n // 4) for i in range(g) for b, n in enumerate(buckets)}

    def once() -> float:
        network = LocalNetwork()
        eps = [network.endpoint(name) for name in names]
        flats = {key: grad.clone() for key, grad in grads.items()}

        async def main():
            async with trio.open_nursery() as nursery:
                t0 = time.perf_counter()
                for b in range(len(buckets)):
                    for i, ep in enumerate(eps):
                        nursery.start_soon(collectives.allreduce_sum, ep, names, ("grads", 0, 0, b), flats[i, b])
            return time.perf_counter() - t0
        return trio.run(main)

    return statistics.median([once() for _ in range(repeats + 1)][1:])


def algorithm(g: int) -> str:
    if g <= DIRECT_REDUCE_MAX:
        return "direct"
    return "halving-doubling" if g & (g - 1) == 0 else "ring"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="yolov2-16")
    parser.add_argument("--devices", default="16,32,64", help="group sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timings a figure is the median of")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds over the group sizes, each size measured right after its calibrations")
    args = parser.parse_args()
    malloc.tune()  # as the swarm command runs every process, `swarm train --in-process` too
    torch.set_num_threads(1)  # the process's one core, which its devices share
    buckets = bucket_bytes(args.model)
    nbytes = float(sum(buckets))
    sizes = [int(x) for x in args.devices.split(",")]
    ways = {"pairs": lambda g: calibrate_pairs(g, buckets, args.repeats),
            "profiles": lambda g: calibrate_profiles(args.repeats)}
    calibrations = {(way, g): [] for way in ways for g in sizes}
    measured = {g: [] for g in sizes}
    predicted = {(way, g): [] for way in ways for g in sizes}
    for _ in range(args.rounds):  # a shared machine's load drifts: each measure right after its calibrations
        for g in sizes:
            for way, calibrate in ways.items():
                figures = calibrate(g)
                calibrations[way, g].append(figures)
                cluster = in_process_cluster(g, *figures)
                predicted[way, g].append(ring_allreduce_time(nbytes, cluster.names, cluster, buckets=len(buckets)))
            measured[g].append(measure(g, buckets, args.repeats))
    print(f"{args.model}: {len(buckets)} buckets, {nbytes / 2**20:.2f} MiB; full-speed figures (medians of "
          f"{args.rounds}), a message and a byte at each end:")
    for (way, g), figures in calibrations.items():
        per_message, per_byte, reduce_message = (statistics.median(c) for c in zip(*figures))
        print(f"  {way}, before the sum of {g}: {per_message * 1e6:.2f} us, "
              f"{per_byte * 1e9:.3f} ns" + (f", and a sum's own {reduce_message * 1e6:.2f} us a message"
                                            if reduce_message else ""))
    print("| devices | algorithm | messages a member | rounds | measured s | predicted s (pairs) | ratio "
          "| predicted s (profiles) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g in sizes:
        cells = []
        for way in ways:  # each ratio the median of the rounds' predicted / measured
            ratio = statistics.median(p / m for p, m in zip(predicted[way, g], measured[g]))
            cells += [f"{statistics.median(predicted[way, g]):.4f}", f"{ratio:.2f}"]
        print(f"| {g} | {algorithm(g)} | {allreduce_messages(g) * len(buckets)} | {allreduce_rounds(g)} | "
              f"{statistics.median(measured[g]):.4f} | {' | '.join(cells)} |", flush=True)

if __name__ == "__main__":
    main()
