"""`swarm plot`: a picture of a run's --metrics file (loss, samples/s, utilisation per device)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's --metrics file",
                       description="Draw loss, samples/s and each device's utilisation against the step from the "
                                   "file `swarm train --metrics FILE` wrote, with re-plans and lost devices marked.")
    p.add_argument("metrics", metavar="METRICS.jsonl", help="a file written by swarm train --metrics")
    p.add_argument("--out", metavar="PNG", help="the picture (default: METRICS.png beside the file)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from swarm.errors import SwarmError
    from swarm.local.metrics_plot import draw_run, read_metrics

    metrics = read_metrics(args.metrics)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SwarmError("swarm plot draws with matplotlib, which is not installed: pip install 'swarm-train[plot]' "
                         "(or pip install matplotlib)") from None
    out = args.out or str(Path(args.metrics).with_suffix(".png"))
    marks = f"; {len(metrics.replans)} re-plan(s)" if metrics.replans else ""
    try:
        draw_run(metrics, out, f"{Path(args.metrics).name}: {len(set(metrics.steps))} steps{marks}")
    except OSError as exc:
        raise SwarmError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"picture: {out}")
    return 0
