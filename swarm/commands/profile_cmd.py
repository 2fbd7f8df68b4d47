"""`swarm profile`: measure this device for the planner and cache the result."""
from __future__ import annotations

import argparse
import json
import sys

from swarm.commands.flags import IMG_SIZE_HELP, image_size, model_name, positive_int
from swarm.errors import SwarmError


def batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of whole numbers such as 1,2,4,8") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be at least 1, got '{text}'")
    return sizes


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this device for the planner",
                       description="Time every layer's forward, backward and update at several batch sizes, the "
                                   "memory a training step needs, and cache it in the state directory (swarm plan "
                                   "and swarm train use the cache).")
    p.add_argument("--model", type=model_name, default="yolov2-16",
                   help="a built-in model or a .cfg path (default: yolov2-16)")
    p.add_argument("--img-size", type=image_size, metavar="N|WxH", help=f"input size: {IMG_SIZE_HELP} (default: as "
                   "swarm train: 128 for the built-in YOLO models (256 yolov4-tiny), a .cfg file's own)")
    p.add_argument("--classes", type=positive_int, help="classes of the head (default: the built-in data's)")
    p.add_argument("--batch-sizes", type=batch_sizes, default=None, metavar="1,2,4,8",
                   help="batch sizes to time (default: 1,2,4,8)")
    p.add_argument("--repeats", type=positive_int, default=None, help="timings per measurement, median kept (default: 5)")
    p.add_argument("--threads", type=positive_int, help="compute threads (default: all usable cores, "
                   "fewer where OMP_NUM_THREADS says)")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), help="where to run the layers: cpu, or cuda (timed by "
                   "CUDA events, with the host<->GPU copy rate and the GPU's memory; default: cuda when torch sees "
                   "a GPU, else cpu)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory (default: $SWARM_STATE_DIR, /var/lib/swarm as "
                   "root, else ~/.local/share/swarm)")
    p.add_argument("--out", metavar="FILE", help="also write the profile here (to describe this device in a cluster file)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from swarm.host.state import state_dir_from
    from swarm.local.compute_device import compute_device
    from swarm.profiling.profiler import DEFAULT_BATCH_SIZES, DEFAULT_REPEATS, load_or_profile, write_profile

    log = lambda text: print(f"profiling: {text}", file=sys.stderr, flush=True)  # noqa: E731
    from swarm.zoo import default_img_size

    args.img_size = default_img_size(args.model, args.img_size)  # what swarm train and plan use
    profile, _, path = load_or_profile(args.model, args.img_size, args.classes, state_dir_from(args.state_dir),
                                       args.batch_sizes or DEFAULT_BATCH_SIZES, args.repeats or DEFAULT_REPEATS,
                                       args.threads, refresh=True, log=log,
                                       accelerator=compute_device(args.accelerator).type)
    if args.out:
        write_profile(profile, Path(args.out))
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
        return 0
    print(profile_table(profile))
    print(f"\ncached in {path}" + (f"; written to {args.out}" if args.out else ""))
    return 0


def profile_table(profile) -> str:
    from planner.report import table
    from planner.units import format_bytes, format_seconds
    from swarm.zoo import describe_model

    try:
        desc = describe_model(profile.model, profile.img_size, profile.classes)
    except SwarmError:
        desc = None
    costs = profile.costs
    sizes = costs.batch_sizes
    rows = []
    for i in range(costs.num_layers):
        kind = desc.layers[i].kind if desc else ""
        rows.append([str(i), kind] + [f"{1e3 * costs.fwd[i, k]:.2f} / {1e3 * costs.bwd[i, k]:.2f}" for k in range(len(sizes))]
                    + [f"{1e3 * costs.update[i]:.2f}", format_bytes(profile.act_bytes[i])])
    header = ["layer", "kind"] + [f"batch {b}: fwd / bwd ms" for b in sizes] + ["update ms", "kept/sample"]
    accelerator = profile.device.get("accelerator")
    where = (f"{accelerator['note']} ({accelerator['kind']}; copies to and from the host at "
             f"{accelerator['copy_gbps']:g} GB/s; "
             + ("memory shared with the CPU" if accelerator["shared_memory"] else
                f"{format_bytes(accelerator['memory'])} free on it") + ")") if accelerator else \
        f"{profile.device.get('cpu')}, {profile.device.get('threads')} threads"
    lines = [f"{profile.model} at {profile.img_size} on {profile.device.get('name')} "
             f"({where}; fingerprint {profile.device.get('fingerprint')})", "", table(rows, header), ""]
    steps = []
    for b in sizes:
        model_sum = costs.range_time(0, costs.num_layers, b, with_loss=True) + float(costs.update.sum())
        steps.append([str(b), format_seconds(profile.step_time.get(b, float("nan"))), format_seconds(model_sum),
                      format_bytes(profile.peak_bytes[b]) if b in profile.peak_bytes else "-"])
    lines.append(table(steps, ["batch", "whole step (measured)", "sum of layers", "peak memory above runtime"
                               + (" (on the GPU)" if accelerator and not accelerator["shared_memory"] else "")]))
    lines.append(f"\nruntime (torch initialised, no model): {format_bytes(profile.runtime_bytes)}"
                 + (f", on {profile.device['allocator']}" if profile.device.get("allocator") else ""))
    if not profile.step_time:
        lines.append("the model is too big to step whole on this device: its layers were measured in pieces "
                     "of it, so there are no whole steps or their peaks")
    return "\n".join(lines)
