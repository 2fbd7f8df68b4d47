"""Rama et al.'s planner: the feature-map-heavy front of the network as one tiles stage.

The stage covers the longest tileable run of layers from the input (tiles.layout.
tileable_prefix: windows, and the residual and CSP blocks among them; for deep networks at
most MAX_TILES_LAYERS of them, ending where a tiles stage can end); the rest of the
network, if any, follows as one stage on the fastest device outside the group (or the
group's device with the most memory). The group is the k fastest devices for k = 2, 4, 8,
..., N - 1 (leaving a device for the rest) and N, one tile each, on the most square grid
of k tiles the maps allow. Each candidate is simulated with a sync at every layer, in the
order of their floors (quick_floor, then candidate_floor; planner/bounds.py), but not
where the floor shows it cannot beat the best so far (or auto's best step); for the
best — unless its syncs take under 2% of the step, when fewer syncs cannot pay for the
recomputation they cost — the tiles cost model's grouping choice (tiles.cost.
choose_grouping: its dynamic program over sync points, from the devices' speed and link)
gives the syncs, and whichever of the two simulates faster is the plan. When the tiles
stage is the whole network, as many micro-batches run through it as one block as fit.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from planner.baselines import square_grid
from planner.bounds import FLOOR_SLACK, compute_floor
from planner.classes import device_classes
from planner.inputs import NoPlan, PlanInputs
from planner.plan import Plan, PlanError, Stage
from planner.tiles_work import tiles_allreduce_time
from tiles.cost import choose_grouping
from tiles.stage_graph import tileable_ends
from tiles.regions import TilingError


SYNC_SHARE_WORTH_GROUPING = 0.02  # below this share of the step, fewer syncs cannot pay for recomputation
MAX_TILES_LAYERS = 24  # a tiles stage for the feature-map-heavy front, not a whole deep network


def tiles_end(inputs: PlanInputs) -> int:
    """Where the tiles stage ends: the tileable front, or for deep networks the end with the
    smallest activation among those within the first MAX_TILES_LAYERS (the latest of equals;
    inside a residual block no stage can end, tiles.stage_graph.tileable_ends)."""
    ends = tileable_ends(inputs.desc)
    if not ends or ends[-1] <= MAX_TILES_LAYERS:
        return ends[-1] if ends else 0
    within = [b for b in ends if b <= MAX_TILES_LAYERS] or ends[:1]
    return min(within, key=lambda b: (inputs.mem.boundary(b), -b))


def effective_flops(inputs: PlanInputs, device: str, first: int, last: int) -> float:
    """The device's FLOP/s on layers [first, last), forward and backward, at the micro-batch size."""
    desc = inputs.desc
    flops = sum(layer.flops + layer.backward_flops for layer in desc.layers[first:last]) * inputs.microbatch
    t = inputs.cluster.device(device).costs.range_time(first, last, inputs.microbatch)
    return flops / t if t > 0 else float("inf")


def rest_device(inputs: PlanInputs, group: list[str]) -> str:
    """Who runs the layers after the tiles: the fastest device outside the group, else the
    group's device with the most memory."""
    cl = inputs.cluster
    outside = [d for d in cl.by_speed(inputs.microbatch) if d not in group]
    return outside[0] if outside else max(group, key=lambda d: (cl.device(d).memory, -group.index(d)))


def tiles_stages(inputs: PlanInputs, group: list[str], grid: tuple[int, int], end: int, syncs: list[int],
                 back_syncs: list[int] | None) -> list[Stage]:
    stages = [Stage(0, end, "tiles", list(group), grid=grid, tile_devices=list(group), syncs=list(syncs),
                    back_syncs=list(back_syncs) if back_syncs is not None else None)]
    if end < inputs.num_layers:
        stages.append(Stage(end, inputs.num_layers, "single", [rest_device(inputs, group)]))
    return stages


def plan_tiles(inputs: PlanInputs, bound: float | None = None) -> Plan | None:
    """The best tiles front (module docstring). Candidates are simulated in the order of
    their compute floors (planner/bounds.py: halos recomputed included), and not where the
    floor cannot beat the best so far; with `bound` (auto's best step so far), None where
    none could beat it."""
    end = tiles_end(inputs)
    if end == 0:
        raise NoPlan(f"{inputs.desc.name} cannot be tiled: its first layer is not a convolution or local pooling")
    cl = inputs.cluster
    fastest = cl.by_speed(inputs.microbatch)
    n = len(fastest)
    if n < 2:
        raise NoPlan("tiles need two devices or more; one device runs the network whole (local)")
    sizes = sorted({k for k in (2 ** i for i in range(1, 8)) if k <= n} | {n} | ({n - 1} if n > 2 else set()))
    candidates = []  # (quick floor, order, plan, group, grid)
    for order, k in enumerate(sizes):
        group = fastest[:k]
        grid = square_grid(k, *inputs.desc.layers[0].in_shape[1:])
        plan = inputs.plan(tiles_stages(inputs, group, grid, end, list(range(end)), None), "tiles")
        candidates.append((quick_floor(inputs, plan), order, plan, group, grid))

    def beaten(floor: float) -> bool:
        return (bound is not None and floor >= bound) or (best is not None and not best[0][0] and floor >= best[0][1])

    best = None  # (key, plan, group, grid, timeline)
    for quick, order, plan, group, grid in sorted(candidates, key=lambda c: (c[0], c[1])):
        if beaten(quick):
            break
        try:
            if beaten(candidate_floor(inputs, plan)):
                continue
            timeline = inputs.simulate(plan)
        except PlanError:
            continue  # the grid does not fit the maps
        key = (not timeline.fits, timeline.step_time, order)
        if best is None or key < best[0]:
            best = (key, plan, group, grid, timeline)
    if best is None:
        if bound is not None:
            return None
        raise NoPlan(f"no grid of tiles fits the maps of {inputs.desc.name} at {inputs.desc.img_size}")
    _, plan, group, grid, timeline = best
    candidates, timelines = [plan], [timeline]
    work = timeline.works[0]
    syncing = inputs.microbatches * (work.sync_fwd + work.sync_bwd)
    if len(group) > 1 and syncing > SYNC_SHARE_WORTH_GROUPING * timeline.step_time:
        slowest = min(effective_flops(inputs, d, 0, end) for d in group)
        try:
            choice = choose_grouping(inputs.desc.layers[0:end], grid, flops_per_s=slowest,
                                     bytes_per_s=cl.min_bw(group), latency_s=cl.latency, samples=inputs.microbatch)
            grouped = inputs.plan(tiles_stages(inputs, group, grid, end, list(choice.grouping.forward),
                                               list(choice.grouping.backward)), "tiles")
            candidates.append(grouped)
            timelines.append(inputs.simulate(grouped))
        except TilingError:
            pass
    k = min(range(len(candidates)), key=lambda i: (not timelines[i].fits, timelines[i].step_time))
    plan, timeline = candidates[k], timelines[k]
    if len(plan.stages) == 1 and timeline.fits:
        plan, timeline = run_together(inputs, plan, timeline)
    plan.predicted = timeline.summary()
    return plan


def together_sizes(inputs: PlanInputs, plan: Plan) -> list[int]:
    """The blocks of micro-batches a candidate may end up run in: one at a time, or, being
    the whole network, any divisor of M (run_together)."""
    m = inputs.microbatches
    return [1, *(d for d in range(2, m + 1) if m % d == 0)] if len(plan.stages) == 1 else [1]


def quick_floor(inputs: PlanInputs, plan: Plan) -> float:
    """A floor under candidate_floor without the tiles cost model: at each layer the stage's
    devices move in lock-step and their tiles' shares of the layer add up to the whole at
    least, so the layer takes no less than all of them together would on a whole micro-
    batch. Devices of one class count once (planner/classes.py)."""
    cl, front = inputs.cluster, plan.stages[0]
    kinds = device_classes(cl)
    count = Counter(kinds[cl.index(d)] for d in front.devices)
    lockstep = float("inf")
    for together in together_sizes(inputs, plan):
        size = inputs.microbatch * together
        block = 0.0
        for layer in range(front.first, front.last):
            for kind in ("fwd", "bwd"):
                rate = 0.0
                for c, n in count.items():
                    costs = cl.devices[c].costs
                    t = getattr(costs, f"{kind}_range")(layer, layer + 1, size) * costs.tiles_overhead
                    rate += n / t if t > 0 else float("inf")
                block += 1 / rate
        lockstep = min(lockstep, inputs.microbatches // together * block)
    floor = (lockstep + tiles_allreduce_time(front, inputs.mem, cl) + 2 * cl.latency
             + max(cl.device(d).costs.update_range(front.first, front.last) for d in front.devices))
    for stage in plan.stages[1:]:  # the rest of the network on one device
        costs = cl.device(stage.devices[0]).costs
        floor = max(floor, inputs.microbatches * costs.range_time(stage.first, stage.last, inputs.microbatch, True)
                    + costs.update_range(stage.first, stage.last))
    return floor * (1 - FLOOR_SLACK)


def candidate_floor(inputs: PlanInputs, plan: Plan) -> float:
    """The least step a candidate can come to (planner/bounds.py), run as it is or, being the
    whole network, with its micro-batches in blocks (run_together)."""
    return min(compute_floor(inputs.plan([replace(plan.stages[0], together=size)], plan.planner), inputs)
               for size in together_sizes(inputs, plan))


def run_together(inputs: PlanInputs, plan: Plan, timeline):
    """A one-stage tiles plan with as many of its micro-batches run as one block as the
    devices' memory holds (the largest divisor of M whose plan still fits): the same
    result, one exchange per sync for all of them. The simulator sees little gain in it, as
    it does not count what each exchange costs a device's CPU; on the testbed (0.2 core,
    100 Mbit/s, yolov2-16 at 416, batch 8 in 8) the same 2x2 plan ran at 0.65-0.68
    samples/s one micro-batch at a time and 0.77-1.02 with all 8 as one block."""
    m = inputs.microbatches
    for size in sorted((d for d in range(2, m + 1) if m % d == 0), reverse=True):
        together = inputs.plan([replace(plan.stages[0], together=size)], plan.planner)
        try:
            t = inputs.simulate(together)
        except PlanError:
            continue
        if t.fits:
            return together, t
    return plan, timeline
