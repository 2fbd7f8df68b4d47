"""The picture of a plan: one step's 1F1B timeline per device (a Gantt chart with transfers)
and, for tiles stages, the grid of tiles over the stage's input map."""
from __future__ import annotations

from planner.plan import Plan
from planner.simulator import Timeline
from planner.tiles_work import tiles_cost
from planner.units import format_bytes, format_seconds

STAGE_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
                 "#CCB974", "#64B5CD"]
DEVICE_COLOURS = ["#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c",
                  "#e31a1c", "#ff7f00", "#6a3d9a", "#b15928"]


def _lighter(hex_colour: str, amount: float = 0.45) -> tuple[float, float, float]:
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def draw_plan(plan: Plan, timeline: Timeline, desc, path: str, title: str | None = None) -> None:
    # matplotlib is optional (the "plot" extra): only drawing a picture needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    devices = plan.used_devices()
    extra = [e.device for e in timeline.events if e.device not in devices]
    devices += list(dict.fromkeys(extra))  # e.g. a data source that only sends images
    tiles_stages = [i for i, s in enumerate(plan.stages) if s.mode == "tiles"]
    n_rows = len(devices)
    # heights in inches, top to bottom: title and legend, the Gantt chart, its axis label, the tile grids
    head, gantt, axis, grids = 1.3, 0.2 + 0.72 * n_rows, 0.6, (3.0 if tiles_stages else 0.0)
    fig_h = head + gantt + axis + grids
    fig = plt.figure(figsize=(14, fig_h))
    ax = fig.add_axes([0.11, (grids + axis) / fig_h, 0.86, gantt / fig_h])
    step = timeline.step_time
    ypos = {d: n_rows - 1 - k for k, d in enumerate(devices)}
    for e in timeline.events:
        y = ypos[e.device]
        width = e.end - e.start
        colour = STAGE_COLOURS[e.stage % len(STAGE_COLOURS)]
        if e.kind in ("F", "B"):
            face = _lighter(colour) if e.kind == "F" else colour
            ax.add_patch(Rectangle((e.start, y + 0.22), width, 0.56, facecolor=face, edgecolor="white", linewidth=0.6))
            if width > step * 0.018:
                ax.text(e.start + width / 2, y + 0.5, f"{e.kind}{e.micro}", ha="center", va="center", fontsize=7,
                        color="black" if e.kind == "F" else "white")
        elif e.kind == "update":
            ax.add_patch(Rectangle((e.start, y + 0.22), max(width, step * 0.002), 0.56, facecolor="#444444"))
        elif e.kind == "allreduce":
            ax.add_patch(Rectangle((e.start, y + 0.02), width, 0.16, facecolor="#9467bd", hatch="///",
                                   edgecolor="white", linewidth=0))
        else:  # send / input: a thin bar under the sender's row
            face = "#2ca02c" if e.kind == "input" else "#7f7f7f"
            ax.add_patch(Rectangle((e.start, y + 0.02), max(width, step * 0.001), 0.16, facecolor=face,
                                   edgecolor="white", linewidth=0.3))
            if width > step * 0.05 and e.peer:
                ax.text(e.start + width / 2, y + 0.1, f"→{e.peer}", ha="center", va="center", fontsize=6, color="white")
    ax.set_xlim(0, step * 1.01 if step > 0 else 1)
    ax.set_ylim(-0.1, n_rows)
    ax.set_yticks([ypos[d] + 0.5 for d in devices])
    labels = []
    for d in devices:
        peak, budget = timeline.peak_memory.get(d), timeline.budgets.get(d)
        mem = f"\n{format_bytes(peak)} / {format_bytes(budget)}" if peak is not None else "\n(data source)"
        labels.append(d + mem)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("seconds into the step")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    for k in range(n_rows + 1):
        ax.axhline(k - 0.0, color="#eeeeee", linewidth=0.5)
    status = "" if timeline.fits else "  —  DOES NOT FIT IN MEMORY"
    micro = f"{plan.microbatches} micro-batch" + ("es" if plan.microbatches > 1 else "")
    heading = title or (f"{plan.model} {plan.img_size}, batch {plan.batch_size} in {micro} — "
                        f"{plan.planner}: step {format_seconds(step)}, "
                        f"{timeline.throughput:.3g} samples/s{status}")
    fig.suptitle(heading, fontsize=11, y=1 - 0.2 / fig_h)
    handles = [Patch(facecolor=_lighter(STAGE_COLOURS[i % len(STAGE_COLOURS)]), label=f"stage {i} fwd "
                     f"(layers {s.first}-{s.last - 1}, {s.mode})") for i, s in enumerate(plan.stages)]
    handles += [Patch(facecolor=STAGE_COLOURS[i % len(STAGE_COLOURS)], label=f"stage {i} bwd")
                for i in range(len(plan.stages))]
    handles += [Patch(facecolor="#7f7f7f", label="send activations / gradients"),
                Patch(facecolor="#2ca02c", label="send images"),
                Patch(facecolor="#9467bd", hatch="///", label="all-reduce"), Patch(facecolor="#444444", label="update")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.54, 1 - 0.5 / fig_h), ncol=min(6, len(handles)),
               fontsize=7, frameon=False)
    if tiles_stages:
        _draw_tiles(fig, plan, timeline, desc, tiles_stages, devices, (grids - 0.7) / fig_h)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_tiles(fig, plan: Plan, timeline: Timeline, desc, stages: list[int], devices: list[str],
                height: float) -> None:
    from matplotlib.patches import Rectangle  # optional, as in draw_plan

    n = len(stages)
    for k, p in enumerate(stages):
        stage = plan.stages[p]
        lay = tiles_cost(desc, stage).layout
        _, h, w = lay.map_shape(stage.first)
        ax = fig.add_axes([0.11 + k * 0.86 / n, 0.02, min(0.86 / n - 0.02, height * 1.4), height])
        for t, dev in enumerate(stage.tile_devices):
            colour = DEVICE_COLOURS[devices.index(dev) % len(DEVICE_COLOURS)]
            own = lay.tiles[t].own[stage.first]
            ax.add_patch(Rectangle((own.cols.lo, own.rows.lo), own.cols.size, own.rows.size, facecolor=colour,
                                   edgecolor="black", linewidth=0.8))
            ax.text(own.cols.lo + own.cols.size / 2, own.rows.lo + own.rows.size / 2, f"tile {t}\n{dev}",
                    ha="center", va="center", fontsize=7)
            inp = lay.input_rect(t)
            ax.add_patch(Rectangle((inp.cols.lo, inp.rows.lo), inp.cols.size, inp.rows.size, fill=False,
                                   edgecolor="black", linestyle=":", linewidth=0.8))
        ax.set_xlim(0, w)
        ax.set_ylim(h, 0)
        ax.set_aspect("equal")
        ax.set_xticks([0, w])
        ax.set_yticks([0, h])
        ax.tick_params(labelsize=6)
        syncs = stage.forward_syncs()
        sync = "every layer" if syncs == list(range(stage.first, stage.last)) else ",".join(map(str, syncs))
        halo = max(t.halo_bytes for t in tiles_cost(desc, stage).tiles)
        rows, cols = stage.grid
        ax.set_title(f"stage {p}: layers {stage.first}-{stage.last - 1}, {rows} row{'s' * (rows > 1)} × {cols} "
                     f"column{'s' * (cols > 1)} of tiles over the {w}×{h} input\n"
                     f"forward syncs: {sync}; halo ≤ {format_bytes(halo)} per sample per tile"
                     "\n(dotted: what each tile reads, halo included)", fontsize=7)
