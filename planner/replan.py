"""Changing a running plan: over the devices left after a loss, or with ones that came (pure).
Who backs up whom, and which layers then move where: planner/backups.py.

Lightweight (Asteroid section 3.4): keep the plan's shape and shift it. A dp group deals the
lost replica's samples to the survivors (replicas of dp groups: inside its group, or a lost
group's micro-batches to the other groups), a tiles stage is re-gridded over its survivors, and
a stage left with no device gives its layers to its neighbours in proportion to their
compute (FLOPs-based, moving the stage boundaries a little). Heavy: plan again over the
devices there are. `replan` tries the light way and says why it took the other when it
must.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from planner.backups import backup_holders
from planner.baselines import simple_plan, square_grid
from planner.memory_fit import describe as describe_overflows
from planner.memory_fit import memory_overflows
from planner.model_desc import ModelDesc
from planner.plan import Plan, PlanError, Stage, most_replicas


def stage_flops(desc: ModelDesc, first: int, last: int) -> float:
    return float(sum(desc.layers[i].flops + desc.layers[i].backward_flops for i in range(first, last)))


def bottleneck(plan: Plan, desc: ModelDesc, speed: dict[str, float] | None = None) -> float:
    """FLOPs per unit of speed on the busiest device (lower is faster): a plan's cost for
    comparing re-plans when nothing better is known."""
    load: dict[str, float] = {}
    mb = plan.batch_size / plan.microbatches
    for s in plan.stages:
        work = stage_flops(desc, s.first, s.last) * plan.batch_size
        if s.mode == "dp":  # each device's samples of its replica's micro-batches
            shares = s.replica_shares(plan.microbatches)
            for r in range(s.replica_count()):
                for d in s.replica_devices(r):
                    load[d] = load.get(d, 0.0) + work * s.allocation[d] / mb * shares[r] / plan.microbatches
        elif s.mode == "tiles":
            tiles = len(s.tile_devices)
            for d in s.tile_devices:
                load[d] = load.get(d, 0.0) + work / tiles
        else:  # one device, or replicas that each take their share of the micro-batches
            for d, share in zip(s.devices, s.replica_shares(plan.microbatches)):
                load[d] = load.get(d, 0.0) + work * share / plan.microbatches
    return max(v / (speed or {}).get(d, 1.0) for d, v in load.items())


def _reshare(shares: dict[str, int], survivors: list[str], microbatches: int) -> list[int]:
    """The survivors' shares of the micro-batches: their own, and the lost ones dealt one at a
    time to whichever survivor grows least for its old share (a share says how fast it is)."""
    new = {d: shares[d] for d in survivors}
    for _ in range(microbatches - sum(new.values())):
        d = min(survivors, key=lambda d: (new[d] + 1) / shares[d])
        new[d] += 1
    return [new[d] for d in survivors]


def _shrink_dp_replicas(s: Stage, dead: set[str], mb: int, microbatches: int, speed: dict[str, float]) -> Stage:
    """Replicas of a dp stage without `dead`: a group that lost some devices splits its
    micro-batches among the rest (by speed); the micro-batches of a group that lost them all
    go to the other replicas, each as it kept up."""
    shares = s.replica_shares(microbatches)
    kept: dict[int, dict[str, int]] = {}
    for r in range(s.replica_count()):
        group = s.replica_devices(r)
        left = [d for d in group if d not in dead]
        if left:
            kept[r] = {d: s.allocation[d] for d in left} if len(left) == len(group) else _allocate(left, mb, speed)
    new = _reshare(dict(enumerate(shares)), list(kept), microbatches)
    allocation = {d: n for alloc in kept.values() for d, n in alloc.items()}
    devices = list(allocation)
    if len(kept) == 1:
        if len(devices) == 1:
            return replace(s, mode="single", devices=devices, allocation=None, replicas=None, shares=None, groups=None,
                           warmup=None)
        return replace(s, devices=devices, allocation=allocation, replicas=None, shares=None, groups=None, warmup=None)
    return replace(s, devices=devices, allocation=allocation, replicas=len(kept), shares=new,
                   groups=[len(alloc) for alloc in kept.values()], warmup=None)


def _allocate(devices: list[str], samples: int, speed: dict[str, float]) -> dict[str, int]:
    """Samples in proportion to speed, at least one each while they last (largest remainder)."""
    total = sum(speed.get(d, 1.0) for d in devices)
    raw = {d: samples * speed.get(d, 1.0) / total for d in devices}
    alloc = {d: int(v) for d, v in raw.items()}
    for d in sorted(devices, key=lambda d: raw[d] - alloc[d], reverse=True)[:samples - sum(alloc.values())]:
        alloc[d] += 1
    return alloc


def _regrid(s: Stage, survivors: list[str], desc: ModelDesc, microbatches: int) -> Stage:
    s = replace(s, together=_smaller_block(s.together, len(survivors) / len(s.devices), microbatches))
    rows, cols = square_grid(len(survivors), *desc.layers[s.first].in_shape[1:])
    fits = all(rows <= desc.layers[i].out_shape[1] and cols <= desc.layers[i].out_shape[2]
               for i in range(s.first, s.last))
    if not fits:  # keep the grid; the lost devices' tiles go to the survivors in turn
        tiles, k = [], 0
        for d in s.tile_devices:
            if d not in survivors:
                d, k = survivors[k % len(survivors)], k + 1
            tiles.append(d)
        return replace(s, devices=survivors, tile_devices=tiles, warmup=None)
    return replace(s, devices=survivors, grid=(rows, cols), tile_devices=list(survivors), warmup=None)


def _smaller_block(together: int | None, share: float, microbatches: int) -> int | None:
    """Fewer devices hold larger tiles: a block of micro-batches shrinks with them, so each
    survivor's activations stay about what they were."""
    if not together or together == 1:
        return together
    return max(g for g in range(1, together + 1) if microbatches % g == 0 and g <= max(1.0, together * share))


def lightweight(plan: Plan, desc: ModelDesc, dead: set[str], speed: dict[str, float] | None = None) -> Plan:
    """The plan without `dead`, changed as little as possible; PlanError when it cannot be."""
    speed = speed or {}
    mb = plan.batch_size // plan.microbatches
    stages: list[Stage | None] = []
    for s in plan.stages:
        survivors = [d for d in s.devices if d not in dead]
        if not survivors:
            stages.append(None)
        elif len(survivors) == len(s.devices):
            stages.append(replace(s, warmup=None))
        elif s.replica_count() > 1 and s.mode == "tiles":
            raise PlanError("a replicated tiles stage lost a device")
        elif s.replica_count() > 1 and s.mode == "dp":
            stages.append(_shrink_dp_replicas(s, dead, mb, plan.microbatches, speed))
        elif s.replica_count() > 1 and s.shares:  # the survivors take the lost shares, each as it kept up
            shares = _reshare(dict(zip(s.devices, s.shares)), survivors, plan.microbatches)
            stages.append(replace(s, devices=survivors, replicas=len(survivors) if len(survivors) > 1 else None,
                                  shares=shares if len(survivors) > 1 else None, warmup=None))
        elif s.replica_count() > 1:  # fewer replicas, each taking more micro-batches
            copies = most_replicas(plan.microbatches, len(survivors))
            stages.append(replace(s, devices=survivors[:copies], replicas=copies if copies > 1 else None,
                                  warmup=None))
        elif s.mode == "dp":
            stages.append(replace(s, devices=survivors, allocation=_allocate(survivors, mb, speed), warmup=None))
        elif s.mode == "tiles":
            stages.append(_regrid(s, survivors, desc, plan.microbatches))
        else:
            stages.append(replace(s, devices=survivors, warmup=None))
    # a replicated stage left with one replica takes every micro-batch itself: nothing to deal
    stages = [replace(s, deal=None) if s is not None and s.replica_count() == 1 and s.deal else s for s in stages]
    # stages left without devices: their layers go to the neighbours, in proportion to compute
    while None in stages:
        i = stages.index(None)
        j = i
        while j + 1 < len(stages) and stages[j + 1] is None:
            j += 1  # a run of stages that all lost their devices goes as one block
        lo, hi = plan.stages[i].first, plan.stages[j].last
        before = stages[i - 1] if i > 0 else None
        after = stages[j + 1] if j + 1 < len(stages) else None
        takers = [s for s in (before, after) if isinstance(s, Stage) and s.mode != "tiles"]
        before = before if isinstance(before, Stage) else None
        after = after if isinstance(after, Stage) else None
        if not takers:
            raise PlanError(f"layers {lo}-{hi - 1} lost all their devices and no neighbouring stage can take them")
        if len(takers) == 1:
            cut = hi if takers[0] is before else lo
        else:
            cap_b = sum(speed.get(d, 1.0) for d in before.devices)
            cap_a = sum(speed.get(d, 1.0) for d in after.devices)
            load_b = stage_flops(desc, before.first, before.last)
            load_a = stage_flops(desc, after.first, after.last)
            best = None
            for c in range(lo, hi + 1):  # before takes [lo, c), after takes [c, hi)
                t = max((load_b + stage_flops(desc, lo, c)) / cap_b, (load_a + stage_flops(desc, c, hi)) / cap_a)
                if best is None or t < best[0]:
                    best = (t, c)
            cut = best[1]
        # a stage that takes layers takes their buckets: its sums go top layer first again
        if before is not None and cut > lo:
            stages[i - 1] = replace(before, last=cut, sum_order=None)
        if after is not None and cut < hi:
            stages[j + 1] = replace(after, first=cut, sum_order=None)
        for k in range(i, j + 1):
            stages[k] = "gone"  # type: ignore[assignment]
    new_stages = [s for s in stages if s != "gone"]
    new = Plan(plan.model, plan.img_size, plan.batch_size, plan.microbatches, new_stages,
               devices={d: f for d, f in plan.devices.items() if d not in dead}, planner=f"{plan.planner}, shifted")
    new.validate(desc)
    new.backups = backup_holders(new)
    return new


def heavy(plan: Plan, desc: ModelDesc, devices: list[str], strategy: str, facts: dict | None = None) -> Plan:
    """Plan again from scratch over `devices` with `strategy`."""
    new = simple_plan(strategy, desc, devices, plan.batch_size, plan.microbatches,
                      facts={d: (facts or {}).get(d, plan.devices.get(d, {})) for d in devices})
    new.backups = backup_holders(new)
    new.planner = f"{strategy}, re-planned"
    return new


@dataclass
class Replan:
    plan: Plan
    how: str  # "lightweight" or "heavy"
    why: str


def replan(plan: Plan, desc: ModelDesc, dead: set[str], alive: list[str], strategy: str,
           speed: dict[str, float] | None = None, prefer: str = "auto") -> Replan:
    """A plan without `dead` (over `alive`, which may include devices new to the plan).
    Neither way gives a plan that cannot fit the devices' memory (planner.memory_fit):
    one that did would lose its devices one after another."""
    gone = f"lost {', '.join(sorted(dead))}" if dead else "none lost"
    joined = [d for d in alive if d not in plan.used_devices()]
    if prefer != "heavy" and not joined:
        try:
            light = lightweight(plan, desc, dead, speed)
        except PlanError as exc:
            why = f"the light way cannot: {exc}"
        else:
            short = _overflows(light, desc)
            if short:
                why = f"the shifted plan does not fit: {describe_overflows(short)}"
            elif prefer == "light":
                return Replan(light, "lightweight", f"{gone}: shifted the plan as asked")
            else:
                try:
                    full = heavy(plan, desc, alive, strategy)
                except PlanError:
                    full = None
                if full is None or _overflows(full, desc):
                    return Replan(light, "lightweight", f"{gone}: shifted the plan (no fresh plan fits)")
                if bottleneck(light, desc, speed) <= 1.25 * bottleneck(full, desc, speed):
                    return Replan(light, "lightweight", f"{gone}: shifted the plan, within 25% of a fresh "
                                                        "plan's busiest device")
                return Replan(full, "heavy", f"{gone}; a fresh plan's busiest device has over 25% less "
                                             "work: planned again")
    else:
        why = f"{', '.join(joined)} joined" if joined else "asked for"
    full = heavy(plan, desc, alive, strategy)
    short = _overflows(full, desc)
    if short:
        raise PlanError(f"no plan over the devices left fits their memory ({describe_overflows(short)})")
    return Replan(full, "heavy", f"{gone}; {why}: planned again")


def _overflows(plan: Plan, desc: ModelDesc) -> list:
    return memory_overflows(plan, desc, {d: f.get("memory") for d, f in plan.devices.items()})


__all__ = ["Replan", "bottleneck", "heavy", "lightweight", "replan"]
