"""The picture of a training run from its --metrics lines: loss, samples/s and each device's
utilisation against the step, with re-plans and lost devices marked."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import SwarmError


@dataclass
class Run:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    utilisation: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # device -> (step, share)
    replans: list[tuple[int, str]] = field(default_factory=list)  # (first step of a new plan, what changed)
    replayed: list[int] = field(default_factory=list)


def read_metrics(path: str) -> Run:
    """The lines of a --metrics file; a line that is not one (a torn last line, another
    file) is named with its number."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SwarmError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise SwarmError(f"{path} is not a text file, so not one `swarm train --metrics` writes") from None
    except OSError as exc:
        raise SwarmError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    run, epoch, devices = Run(), None, None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, loss, rate = int(record["step"]), float(record["loss"]), float(record["samples_per_s"])
        except (ValueError, KeyError, TypeError):
            raise SwarmError(f"{path}:{number} is not a line of `swarm train --metrics` (a JSON object with step, "
                             "loss and samples_per_s)") from None
        run.steps.append(step)
        run.loss.append(loss)
        run.rate.append(rate)
        for device, share in (record.get("utilisation") or {}).items():
            run.utilisation.setdefault(device, []).append((step, float(share)))
        if record.get("replayed"):
            run.replayed.append(step)
        now_epoch, now_devices = record.get("epoch"), record.get("devices")
        if epoch is not None and now_epoch != epoch:
            what = "re-plan"
            if devices is not None and now_devices is not None and now_devices != devices:
                lost = devices - now_devices
                what = f"{lost} device{'s' if abs(lost) > 1 else ''} lost" if lost > 0 else f"{-lost} joined"
            run.replans.append((step, what))
        epoch, devices = now_epoch, now_devices
    if not run.steps:
        raise SwarmError(f"{path} holds no steps")
    return run


def draw_run(run: Run, path: str, title: str) -> None:
    # matplotlib is optional (the "plot" extra): only drawing a picture needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if run.utilisation else 2
    fig, axes = plt.subplots(panels, 1, figsize=(10, 2.6 * panels + 0.6), sharex=True)
    loss_ax, rate_ax = axes[0], axes[1]
    loss_ax.plot(run.steps, run.loss, color="#4C72B0", linewidth=1.2)
    if min(run.loss) > 0 and max(run.loss) / min(run.loss) > 20:
        loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss")
    rate_ax.plot(run.steps, run.rate, color="#55A868", linewidth=1.0)
    rate_ax.set_ylabel("samples/s")
    rate_ax.set_ylim(bottom=0)
    if run.replayed:
        rate_ax.scatter(run.replayed, [run.rate[run.steps.index(s)] for s in run.replayed], s=14, color="#C44E52",
                        zorder=3, label="replayed step")
        rate_ax.legend(loc="lower right", fontsize=8)
    if run.utilisation:
        ax = axes[2]
        for device, points in sorted(run.utilisation.items()):
            xs, ys = [], []
            for k, (s, u) in enumerate(points):
                if k and s > points[k - 1][0] + 1:  # steps it was not in: a gap, not a line across
                    xs.append(math.nan)
                    ys.append(math.nan)
                xs.append(s)
                ys.append(100 * u)
            ax.plot(xs, ys, linewidth=0.9, label=device)
        ax.set_ylabel("utilisation %")
        ax.set_ylim(0, 105)
        ax.legend(loc="lower right", fontsize=7, ncol=min(6, math.ceil(len(run.utilisation) / 2)))
    for step, what in run.replans:
        for ax in axes:
            ax.axvline(step - 0.5, color="#C44E52", linestyle="--", linewidth=0.9)
        axes[0].annotate(what, (step - 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                         textcoords="offset points", fontsize=8, color="#C44E52")
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
