"""`swarm eval`: the held-out metric of a checkpoint (mAP@0.5, or accuracy for classifiers)."""
from __future__ import annotations

import argparse

from swarm.commands.flags import IMG_SIZE_HELP, image_size, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint on held-out data",
                       description="Evaluate a checkpoint on the held-out split of its data set.")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="a checkpoint written by swarm train")
    p.add_argument("--data", help="a YOLO-format folder (default: the data the checkpoint was trained on)")
    p.add_argument("--img-size", type=image_size, metavar="N|WxH", help=f"input size: {IMG_SIZE_HELP} (default: the "
                   "size the checkpoint was trained at)")
    p.add_argument("--threads", type=positive_int, help="compute threads (default: all usable cores, "
                   "fewer where OMP_NUM_THREADS says)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from swarm.local.files import check_checkpoint

    check_checkpoint(args.checkpoint)  # a mistake is told before torch loads
    from swarm.data import open_datasets
    from swarm.errors import SwarmError
    from swarm.local.checkpoint import load_checkpoint, load_network
    from swarm.local.evaluate import evaluate
    from swarm.local.trainer import set_threads

    set_threads(args.threads)
    state = load_checkpoint(args.checkpoint)
    config = state.get("config", {})
    data = args.data if args.data is not None else config.get("data")
    net, desc, _ = load_network(state, args.checkpoint, args.img_size)
    _, heldout = open_datasets(data, desc.img_size, desc.in_channels)
    if len(heldout) == 0:
        raise SwarmError("the held-out split is empty")
    result = evaluate(net, desc, heldout)
    print(f"{desc.name} at step {state['step']}: {result}")
    if result.per_class is not None:
        names = heldout.classes
        print("  " + ", ".join(f"{names[c] if c < len(names) else c}: {ap:.3f}"
                               for c, ap in enumerate(result.per_class) if ap == ap))
    return 0
