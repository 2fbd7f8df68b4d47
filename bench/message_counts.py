"""Messages and bytes each device sends in one training step of a plan, by kind.

    python bench/message_counts.py [--strategy tiles] [--devices 4] [--img-size 128]
                                   [--batch-size 8] [--microbatches 8]

Runs one step of `swarm train --strategy S --devices N` inside this process (every device a
task, the network in memory, as the execution tests do) and counts what the devices send one
another: halos, BatchNorm gathers, gradient rings, activations. The counts do not depend on
the machine; the bytes scale with the image size.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="tiles", choices=["tiles", "dp", "pp", "hybrid"])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--model", default="yolov2-16")
    p.add_argument("--img-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    args = p.parse_args()

    from planner.baselines import simple_plan
    from swarm.data import open_datasets
    from swarm.execution import endpoint
    from swarm.execution.inprocess import train_plan_in_process
    from swarm.local.trainer import LocalTrainer, TrainConfig

    counts: collections.Counter = collections.Counter()
    sizes: collections.Counter = collections.Counter()
    send = endpoint.LocalEndpoint.send

    async def counting(self, dst, key, payload):
        if "coordinator" not in (dst, self.name) and dst != self.name:
            counts[key[0]] += 1
            sizes[key[0]] += sum(a.numel() * a.element_size() for a in payload.get("arrays") or [])
        return await send(self, dst, key, payload)
    endpoint.LocalEndpoint.send = counting

    cfg = TrainConfig(model=args.model, img_size=args.img_size, batch_size=args.batch_size,
                      microbatches=args.microbatches, seed=7, classes=5)
    trainer = LocalTrainer(cfg)
    devices = [f"d{i}" for i in range(args.devices)]
    plan = simple_plan(args.strategy, trainer.desc, devices, args.batch_size, args.microbatches,
                       together=args.microbatches if args.strategy == "tiles" else None)
    data, _ = open_datasets(None, args.img_size, 3)
    train_plan_in_process(plan, trainer, data, 1, timeout_s=600)
    n = len(plan.used_devices())
    print(f"{args.model} at {args.img_size}, {args.strategy} over {n}: per device per step")
    print(f"{'kind':<10} {'messages':>9} {'MB':>8}")
    for kind in sorted(counts):
        print(f"{kind:<10} {counts[kind] / n:>9.1f} {sizes[kind] / n / 1e6:>8.2f}")
    print(f"{'all':<10} {sum(counts.values()) / n:>9.1f} {sum(sizes.values()) / n / 1e6:>8.2f}")


if __name__ == "__main__":
    main()
