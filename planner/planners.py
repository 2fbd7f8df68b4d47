"""Every planner by name, `auto`, and comparing them all on the same inputs.

    plan = make_plan("auto", inputs)
    rows = compare(inputs)      # one CompareRow per planner: plan or the reason there is none

auto takes the best predicted plan of all the planners, and also tries hybrids the single
planners do not build: the tileable front of the network as a tiles stage on the k fastest
devices, followed by Asteroid's pipeline (dp and single stages) over the layers after it on
the other devices; and pipelines of replicated stages, each stage a few devices taking whole
micro-batches in turn (planner/replicated.py). A plan that fits beats one that does not; then
the shorter step. The planners that search many candidates are given the best step found
before them and leave out what cannot beat it (planner/bounds.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from planner.asteroid import AsteroidDP, pipeline_plan, plan_asteroid
from planner.baselines import plan_dp, plan_local, plan_pp, square_grid
from planner.bounds import best_step, compute_floor
from planner.checkpoint import checkpointing
from planner.mapping import can_map, mapping
from planner.hiertrain import plan_hiertrain
from planner.inputs import NoPlan, PlanInputs
from planner.memory import recomputable
from planner.jointdnn import plan_jointdnn
from planner.plan import Plan, PlanError, Stage
from planner.recompute import recomputing
from planner.replicated import plan_replicated
from planner.tiles_planner import plan_tiles, tiles_end

HYBRID_CANDIDATES = 2  # Asteroid pipelines tried after each tiles front


def _fits_then_time(plan: Plan) -> tuple[bool, float]:
    return (not plan.predicted["fits"], plan.predicted["step_time_s"])


def plan_hybrids(inputs: PlanInputs, tiles_plan: Plan | None, bound: float | None = None) -> list[Plan]:
    """Tiles front + Asteroid pipeline on the remaining devices: the front on as many of the
    fastest devices as the tiles planner chose (if that leaves some), and on half of them.
    With `bound` (auto's best step so far), a front whose devices alone compute longer, and
    pipelines whose devices do (planner/bounds.py), are not tried."""
    end = tiles_end(inputs)
    cl = inputs.cluster
    n = len(cl.names)
    if end == 0 or end >= inputs.num_layers or n < 2 or inputs.batch_size % inputs.microbatches:
        return []
    fastest = cl.by_speed(inputs.microbatch)
    sizes = {max(1, n // 2)}
    if tiles_plan is not None and len(tiles_plan.stages[0].devices) < n:
        sizes.add(len(tiles_plan.stages[0].devices))
    plans = []
    for k in sorted(sizes):
        group, rest = fastest[:k], fastest[k:]
        grid = square_grid(k, *inputs.desc.layers[0].in_shape[1:])
        front = Stage(0, end, "tiles", list(group), grid=grid, tile_devices=list(group), syncs=list(range(end)))
        if bound is not None:
            try:
                if compute_floor(inputs.plan([front], "auto"), inputs) >= bound:
                    continue
            except PlanError:
                continue  # the grid does not fit the maps
        sub = PlanInputs(inputs.desc, inputs.mem, cl.subset(rest), inputs.batch_size, inputs.microbatches)
        dp = AsteroidDP(sub, start=end, bound=bound)
        for pipe in sorted(dp.solve(), key=lambda q: q.estimate)[:HYBRID_CANDIDATES]:
            tail = pipeline_plan(sub, dp, pipe).stages
            plan = inputs.plan([front, *tail], "auto")
            if bound is not None and compute_floor(plan, inputs) >= bound:
                continue
            try:
                plans.append(inputs.finish(plan))
            except PlanError:
                break  # the grid does not fit the maps
    return plans


PLANNERS = {
    "local": plan_local,
    "dp": plan_dp,
    "pp": plan_pp,
    "tiles": plan_tiles,
    "jointdnn": plan_jointdnn,
    "hiertrain": plan_hiertrain,
    "asteroid": plan_asteroid,
}
STRATEGIES = (*PLANNERS, "auto")


# the planners auto runs again for stages that remake BatchNorm, and for stages that checkpoint (plan_auto)
REMAKING = ("local", "dp", "pp")
# the planners that take auto's best step so far and skip what cannot beat it
BOUNDED = {"dp", "tiles", "asteroid"}


def plan_auto(inputs: PlanInputs) -> Plan:
    """The best plan of every planner and the hybrids, keeping every map the backward reads;
    then the one-stage planners and pp again with BatchNorm remade in the backward
    (planner.recompute), again with their stages in checkpointed segments
    (planner.checkpoint), and where every device can, again with the devices mapping their
    largest blocks afresh (planner.mapping), each bounded by the best so far: their plans need
    less memory for more compute, and win where memory held the first search back (a device
    that can then take a larger share of a micro-batch, or whole ones). A plan that remakes
    says so in its single and dp stages, one that checkpoints in all its stages, one that maps
    in Plan.mapped; none does two of them."""
    plan = _plan_auto(inputs)
    if inputs.cluster.recomputing or inputs.cluster.checkpointing or inputs.cluster.mapping:
        return plan
    if recomputable(inputs.desc):
        mem, cluster = recomputing(inputs.mem, inputs.cluster, inputs.desc)
        try:
            other = _plan_auto(replace(inputs, mem=mem, cluster=cluster), best_step(plan), remaking=True)
        except NoPlan:
            other = None
        if (other is not None and any(s.mode != "tiles" for s in other.stages)
                and _fits_then_time(other) < _fits_then_time(plan)):
            for s in other.stages:
                if s.mode != "tiles":
                    s.recompute = True
            plan = other
    mem, cluster = checkpointing(inputs.mem, inputs.cluster, inputs.desc)
    try:
        other = _plan_auto(replace(inputs, mem=mem, cluster=cluster), best_step(plan), checkpoints=True)
    except NoPlan:
        other = None
    if other is not None and other.predicted["fits"] and _fits_then_time(other) < _fits_then_time(plan):
        plan = other
    if can_map(inputs.cluster) and not inputs.cluster.mapping:
        mem, cluster = mapping(inputs.mem, inputs.cluster, inputs.desc)
        try:
            other = _plan_auto(replace(inputs, mem=mem, cluster=cluster), best_step(plan), remaking=True)
        except NoPlan:
            return plan
        if other.predicted["fits"] and _fits_then_time(other) < _fits_then_time(plan):
            other.mapped = True
            plan = other
    return plan


def _checkpointed(plan: Plan, desc) -> Plan:
    """`plan` with every stage checkpointing (Stage.checkpoint); PlanError where it may not
    (a dp group of more than one device, a tiles stage)."""
    other = Plan.from_dict(plan.to_dict())
    for s in other.stages:
        s.checkpoint = True
    other.validate(desc)
    return other


def _plan_auto(inputs: PlanInputs, bound: float | None = None, remaking: bool = False,
               checkpoints: bool = False) -> Plan:
    """The best plan of every planner and the hybrids. Each planner that builds many
    candidates is given the best step found before it, and does not simulate what its
    devices alone cannot compute in less (planner/bounds.py): such a plan could not win.
    `remaking`: the search for stages that remake, which runs only the planners of whole-model
    stages and plain pipelines (REMAKING): where remaking wins, a device takes a larger share of
    a micro-batch, or whole ones; Asteroid's and the hybrids' searches, the longest, are not run
    twice (a tiles stage keeps its maps anyway). `checkpoints`: the same planners for stages
    that checkpoint (inputs' model and devices: planner.checkpoint.checkpointing), their plans
    marked so; a plan that may not checkpoint (Plan.validate: a dp group of several devices)
    is left out, the other candidates of its planner with it."""
    candidates = []
    reasons = []
    best = None
    for name, planner in PLANNERS.items():
        if (remaking or checkpoints) and name not in REMAKING:
            continue
        try:
            plan = planner(inputs, bound=best_step(best, bound)) if name in BOUNDED else planner(inputs)
        except NoPlan as exc:
            reasons.append(f"{name}: {exc}")
            continue
        if plan is None:  # nothing of this planner's could beat the best so far
            continue
        if checkpoints:
            try:
                plan = _checkpointed(plan, inputs.desc)
            except PlanError as exc:
                reasons.append(f"{name}: {exc}")
                continue
        candidates.append(plan)
        if best is None or _fits_then_time(plan) < _fits_then_time(best):
            best = plan
    tiles_plan = next((p for p in candidates if p.planner == "tiles"), None)
    if not (remaking or checkpoints):
        candidates += plan_hybrids(inputs, tiles_plan, best_step(best, bound))
        try:
            replicated = plan_replicated(inputs, best_step(best, bound))
        except NoPlan as exc:
            reasons.append(f"replicated pipelines: {exc}")
        else:
            if replicated is not None:
                candidates.append(replicated)
    if not candidates:
        raise NoPlan("no planner found a plan: " + "; ".join(reasons))
    best = min(candidates, key=_fits_then_time)
    plan = Plan.from_dict(best.to_dict())
    plan.planner = "auto"
    plan.predicted["chosen"] = best.planner if best.planner != "auto" else "tiles+asteroid"
    return plan


def make_plan(strategy: str, inputs: PlanInputs) -> Plan:
    if strategy == "auto":
        return plan_auto(inputs)
    try:
        planner = PLANNERS[strategy]
    except KeyError:
        raise PlanError(f"unknown strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}") from None
    return planner(inputs)


@dataclass
class CompareRow:
    strategy: str
    plan: Plan | None
    error: str | None
    seconds: float  # how long planning took


def compare(inputs: PlanInputs, strategies=STRATEGIES) -> list[CompareRow]:
    rows = []
    for name in strategies:
        t0 = time.perf_counter()
        try:
            plan, error = make_plan(name, inputs), None
        except NoPlan as exc:
            plan, error = None, str(exc)
        rows.append(CompareRow(name, plan, error, time.perf_counter() - t0))
    return rows
