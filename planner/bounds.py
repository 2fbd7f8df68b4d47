"""Lower bounds on a plan's predicted step, cheap enough to skip simulating what cannot win.

A device computes every forward, backward and update its stages give it, one at a time, in
every step; the simulator's step (settled, or over the step before's sums) is never shorter
than any device's computing (`_Run.overlapped`: the step is at least each device's CPU).
So a plan whose busiest device computes at least as long as the best step found so far
needs no timeline: it cannot be better. The searches that build many candidates (dp's
groups, Asteroid's pipelines, auto's planners one after another) simulate the most
promising first and stop at the first whose floor is no better than the best so far.

    floor = compute_floor(plan, inputs)    # seconds; simulate(plan).step_time >= floor

And for a whole cluster, the least step any plan of whole-model replicas can take
(replica_floor): what whole micro-batches leave of the devices' summed rate.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

from planner.inputs import PlanInputs
from planner.plan import Plan
from planner.tiles_work import tiles_allreduce_time, tiles_bn_time, tiles_compute, tiles_cost

# floating-point room: the simulator adds the same times in another order
FLOOR_SLACK = 1e-9


def compute_floor(plan: Plan, inputs: PlanInputs) -> float:
    """The most seconds any device of `plan` computes in a step: its forwards and backwards
    (the loss on the last stage) on its samples of the micro-batches it runs, and its
    updates. A tiles stage's devices move in lock-step: each computes, per block of
    micro-batches, what its slowest member takes for its tiles at each layer (planner/
    tiles_work.py, halos recomputed included), and waits for the BatchNorm exchanges, which
    no grouping of syncs removes; and a plan with a tiles stage ends every step settled, so
    its tiles devices' gradients are summed after their last backward and the commit comes
    before their updates. Raises PlanError where a grid does not fit the maps."""
    cl, L, mem = inputs.cluster, inputs.num_layers, inputs.mem
    busy: dict[str, float] = defaultdict(float)
    settle: dict[str, float] = defaultdict(float)  # after a device's last backward: its gradients' sum, the commit
    micro, size = plan.microbatches, plan.microbatch_size()
    for stage in plan.stages:
        if stage.mode == "tiles":
            if stage.replica_count() == 1:  # (replicated tiles stages are left out)
                cost = tiles_cost(inputs.desc, stage)
                f, b = tiles_compute(inputs.desc, stage, cl, cost, size * stage.block())
                per_block = f + b + tiles_bn_time(cost, stage.devices, cl)
                summed = tiles_allreduce_time(stage, mem, cl) + 2 * cl.latency
                for d in stage.devices:
                    busy[d] += micro // stage.block() * per_block + cl.device(d).costs.update_range(stage.first,
                                                                                                  stage.last)
                    settle[d] = max(settle[d], summed)
            continue
        with_loss = stage.last == L
        for r, runs in enumerate(stage.replica_shares(micro)):
            for d in stage.replica_devices(r):
                samples = stage.allocation.get(d, 0) if stage.mode == "dp" else size
                costs = cl.device(d).costs
                if samples:
                    busy[d] += runs * costs.range_time(stage.first, stage.last, samples, with_loss)
                busy[d] += costs.update_range(stage.first, stage.last)
    return max((t + settle[d] for d, t in busy.items()), default=0.0) * (1 - FLOOR_SLACK)


def cannot_beat(floor: float, best: Plan | None, bound: float | None = None) -> bool:
    """Whether a candidate whose step is at least `floor` cannot be better than `best` (a
    plan that fits: a shorter step wins, and of equals the one found first) or than `bound`
    (the best step found elsewhere)."""
    if bound is not None and floor >= bound:
        return True
    return best is not None and best.predicted["fits"] and floor >= best.predicted["step_time_s"]


def best_step(best: Plan | None, bound: float | None = None) -> float | None:
    """The step a candidate must beat: the best plan's, if it fits, or the bound from elsewhere."""
    steps = [s for s in (bound, best.predicted["step_time_s"] if best is not None and best.predicted["fits"] else None)
             if s is not None]
    return min(steps) if steps else None


def finish_best(inputs: PlanInputs, candidates: list[Plan], bound: float | None = None,
                best: Plan | None = None) -> Plan | None:
    """Of `candidates` (plans not yet simulated) and `best` (one that was), the one predicted
    best: it fits, then the shorter step, then the one found first. Candidates are finished
    (PlanInputs.finish) in the order of their floors, until a floor shows that neither they
    nor the rest can beat the best, or `bound`. None when nothing was finished."""
    floors = [compute_floor(plan, inputs) for plan in candidates]
    for k in sorted(range(len(candidates)), key=lambda k: floors[k]):
        if cannot_beat(floors[k], best, bound):
            break
        plan = inputs.finish(candidates[k])
        if best is None or _fits_then_time(plan) < _fits_then_time(best):
            best = plan
    return best


def _fits_then_time(plan: Plan) -> tuple[bool, float]:
    return (not plan.predicted["fits"], plan.predicted["step_time_s"])


def sample_rate(inputs: PlanInputs, device: str) -> float:
    """The most samples a second `device` can put through the whole model: at its best time
    per sample, over shares of up to a micro-batch."""
    L, B = inputs.num_layers, inputs.microbatch
    costs = inputs.cluster.device(device).costs
    per_sample = min(costs.range_time(0, L, y, with_loss=True) / y for y in range(1, B + 1))
    return 1.0 / per_sample if per_sample > 0 else float("inf")


def samples_floor(inputs: PlanInputs, rate: float) -> float:
    """The least step any plan computing whole samples of the whole model can take on
    devices of summed `rate` (sample_rate): the batch at that rate."""
    return inputs.batch_size / rate * (1 - FLOOR_SLACK)


MAX_FLOOR_DEVICES = 8  # replica_floor goes through every partition: 4,140 of 8 devices, 21,147 of 9


class ReplicaFloor(NamedTuple):
    """replica_floor's answer: the step, and the groups that give it: each a tuple of device
    names, its whole micro-batches in a step, and each member's samples of a micro-batch."""
    step: float
    groups: list[tuple[tuple[str, ...], int, tuple[int, ...]]]


def replica_floor(inputs: PlanInputs, limit: int = MAX_FLOOR_DEVICES) -> ReplicaFloor | None:
    """The least step of any one-stage plan of whole-model replicas on the cluster, computing
    only: the devices in groups (any partition of them; a group may take nothing), a group
    splitting each of its micro-batches among its members (a dp replica; one device alone is
    a single replica), each member holding its samples (the memory model's share of the
    whole model), the groups taking whole micro-batches, each device busy for its forwards,
    backwards and update. Nothing exchanged, nothing waited for: a plan's predicted step is
    never shorter, and the gap between it and samples_floor is what whole micro-batches cost
    (the samples of one share BatchNorm's statistics, so a device takes part of one only in a
    group that exchanges them at every layer). None for more than `limit` devices."""
    cl, L, B, M, mem = inputs.cluster, inputs.num_layers, inputs.microbatch, inputs.microbatches, inputs.mem
    names = cl.names
    if len(names) > limit:
        return None
    held = {d: min(B, mem.max_batch(0, L, 1, cl.device(d).memory)) for d in names}
    timed: dict[tuple[str, ...], tuple[float, float, tuple[int, ...]] | None] = {}

    def group_time(group: tuple[str, ...]) -> tuple[float, float, tuple[int, ...]] | None:
        """A micro-batch's time on `group`'s slowest member at its best split, its members'
        longest update, and the split; None where no split fits."""
        if group not in timed:
            best = None
            for split in _compositions(B, len(group)):
                if any(s > held[d] for s, d in zip(split, group)):
                    continue
                t = max(cl.device(d).costs.range_time(0, L, s, with_loss=True) for s, d in zip(split, group))
                if best is None or t < best[0]:
                    best = (t, max(cl.device(d).costs.update_range(0, L) for d in group), split)
            timed[group] = best
        return timed[group]

    best: ReplicaFloor | None = None
    for part in _partitions(names):
        able = [(g, gt) for g in part if (gt := group_time(tuple(g))) is not None]
        if not able:
            continue
        step, shares = _least_makespan([(t, u) for _, (t, u, _) in able], M)
        if step is not None and (best is None or step < best.step):
            best = ReplicaFloor(step, [(tuple(g), k, split) for (g, (_, _, split)), k in zip(able, shares) if k])
    return best if best is None else best._replace(step=best.step * (1 - FLOOR_SLACK))


def _least_makespan(groups: list[tuple[float, float]], microbatches: int) -> tuple[float | None, list[int]]:
    """For groups taking t seconds a micro-batch and u for their update (once, if they take
    any), the least step over whole shares summing to `microbatches`, and the shares: the
    least of the steps k t + u at which the groups can take them all."""
    def shares(step: float) -> list[int]:
        return [max(0, math.floor((step - u) / t + 1e-9)) if t > 0 else microbatches for t, u in groups]

    candidates = sorted({k * t + u for t, u in groups for k in range(1, microbatches + 1)})
    for step in candidates:
        taken = shares(step)
        if sum(taken) >= microbatches:
            out, left = [], microbatches
            for k in taken:
                out.append(min(k, left))
                left -= out[-1]
            return step, out
    return None, []


def _compositions(total: int, parts: int):
    """Every way to write `total` as `parts` positive whole numbers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def _partitions(items: list):
    """Every partition of `items` into non-empty groups (each once, groups in no order)."""
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[head], *part]
        for i in range(len(part)):
            yield [*part[:i], [head, *part[i]], *part[i + 1:]]
