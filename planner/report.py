"""Plans and comparisons as text tables for the terminal."""
from __future__ import annotations

from planner.plan import Plan
from planner.simulator import Timeline
from planner.units import format_bytes, format_seconds


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def stage_devices(stage) -> str:
    return (_devices(stage) + ("; BatchNorm remade in the backward" if stage.recompute else "")
            + ("; checkpointed in segments" if stage.checkpoint else ""))


def _devices(stage) -> str:
    if stage.mode == "dp" and stage.replica_count() > 1:
        groups = " | ".join(", ".join(f"{d} ({stage.allocation[d]})" for d in stage.replica_devices(r))
                            for r in range(stage.replica_count()))
        taking = f", taking {'/'.join(str(k) for k in stage.shares)} micro-batches" if stage.shares else ""
        return f"{stage.replica_count()} replicas: {groups}{taking}{overlapping(stage)}"
    if stage.mode == "dp":
        return ", ".join(f"{d} ({stage.allocation[d]})" for d in stage.devices) + overlapping(stage)
    if stage.mode == "tiles":
        rows, cols = stage.grid
        per = {}
        for d in stage.tile_devices:
            per[d] = per.get(d, 0) + 1
        tiles = ", ".join(f"{d}" + (f" x{n}" if n > 1 else "") for d, n in per.items())
        copies = f"{stage.replica_count()} replicas of a " if stage.replica_count() > 1 else ""
        return f"{copies}{rows}x{cols} grid: {tiles}"
    if stage.replica_count() > 1 and stage.shares:
        return f"{stage.replica_count()} replicas: " + ", ".join(f"{d} ({k} micro-batch{'es' if k > 1 else ''})"
                                                                  for d, k in zip(stage.devices, stage.shares))
    if stage.replica_count() > 1:
        return f"{stage.replica_count()} replicas: {', '.join(stage.devices)}"
    return stage.devices[0]


def overlapping(stage) -> str:
    return "; each backward beside the next forward" if stage.overlap else ""


def sync_text(stage) -> str:
    if stage.mode != "tiles":
        return ""
    fwd = stage.forward_syncs()
    if fwd == list(range(stage.first, stage.last)):
        return "sync every layer"
    return "syncs at " + ",".join(str(s) for s in fwd)


def plan_table(plan: Plan, timeline: Timeline) -> str:
    mb = plan.batch_size // plan.microbatches
    warm = plan.warmups()
    head = (f"{plan.model} at {plan.img_size}: batch {plan.batch_size} in {plan.microbatches} "
            f"micro-batch{'es' if plan.microbatches > 1 else ''} of {mb}; planner {plan.planner}"
            + (f" (chose {plan.predicted['chosen']})" if plan.predicted and plan.predicted.get("chosen") else "")
            + ("; every device maps its largest blocks afresh" if plan.mapped else ""))
    rows = []
    for i, s in enumerate(plan.stages):
        layers = _layers(s)
        rows.append([str(i), layers, s.mode, stage_devices(s), str(min(warm[i], plan.microbatches)), sync_text(s)])
    stages = table(rows, ["stage", "layers", "mode", "devices (samples per micro-batch)", "warm-up", ""])
    dev_rows = []
    # what a live device could spare when planned (swarm/host/resources.py), of which its budget is
    # what the runtime leaves: shown where the plan's devices say
    spare = {d: (plan.devices.get(d) or {}).get("spare") for d in plan.used_devices()}
    for d in plan.used_devices():
        peak, budget = timeline.peak_memory[d], timeline.budgets[d]
        busy = timeline.busy.get(d, 0.0)
        accelerator = (plan.devices.get(d) or {}).get("accelerator")
        name = f"{d} ({accelerator})" if accelerator else d
        dev_rows.append([name, ",".join(str(p) for p in plan.stages_of_device(d)), format_seconds(busy),
                         f"{100 * busy / timeline.step_time:.0f}%" if timeline.step_time else "-",
                         format_bytes(peak), format_bytes(budget), format_bytes(budget - peak)]
                        + ([format_bytes(spare[d]) if spare[d] else "-"] if any(spare.values()) else [])
                        + ["yes" if peak <= budget else "NO"])
    devices = table(dev_rows, ["device", "stages", "busy", "use", "peak memory", "budget", "left"]
                    + (["spare"] if any(spare.values()) else []) + ["fits"])
    summary = (f"predicted step {format_seconds(timeline.step_time)}, {timeline.throughput:.3g} samples/s"
               + ("" if timeline.fits else " - DOES NOT FIT"))
    return "\n\n".join([head, stages, devices, summary])


def compare_table(rows) -> str:
    out = []
    best = min((r.plan.predicted["step_time_s"] for r in rows if r.plan and r.plan.predicted["fits"]), default=None)
    for r in rows:
        if r.plan is None:
            out.append([r.strategy, "-", "-", "-", "-", "no plan", format_seconds(r.seconds), r.error or ""])
            continue
        p = r.plan.predicted
        worst = max(p["peak_memory"].items(), key=lambda kv: kv[1])
        shape = " | ".join(f"{_layers(s)} {s.mode}x{len(s.devices)}" + (f" {s.shares}" if s.shares else "")
                           for s in r.plan.stages)
        note = "best" if best is not None and p["fits"] and p["step_time_s"] == best else ""
        if p.get("chosen"):
            note = (note + " " if note else "") + f"= {p['chosen']}"
        out.append([r.strategy, format_seconds(p["step_time_s"]), f"{p['throughput']:.3g}",
                    f"{format_bytes(worst[1])} ({worst[0]})", str(len(r.plan.used_devices())),
                    "yes" if p["fits"] else "NO", format_seconds(r.seconds), f"{shape}  {note}".rstrip()])
    return table(out, ["strategy", "step", "samples/s", "peak memory (device)", "devices", "fits", "planning",
                       "stages"])


def _layers(stage) -> str:
    return f"{stage.first}-{stage.last - 1}" if stage.last - stage.first > 1 else str(stage.first)
