"""Asteroid Algorithm 1: deal a micro-batch's samples out to a group, memory-aware, then
offload samples from the straggler.

Phase 1 (MemoryAwareBalancing) gives each device a share proportional to its capacity
v_d = 1 / (its time for the stage on the whole micro-batch) (eq. 9), capped by the most
samples that fit in its memory budget, and deals what is left over again among the
devices that still have room. Phase 2 (StragglerWorkloadOffloading) moves a block of
samples from the slowest device to the fastest one with room, while that makes the
slowest device faster — time is not linear in the batch size, so phase 1 alone is not
balanced.
"""
from __future__ import annotations

from typing import Callable


def largest_remainder(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Integers proportional to `weights` summing to `total` (ties go to the earlier key)."""
    s = sum(weights.values())
    if total <= 0 or s <= 0:
        return {k: 0 for k in weights}
    exact = {k: total * w / s for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    left = total - sum(out.values())
    order = sorted(weights, key=lambda k: -(exact[k] - out[k]))
    for k in order[:left]:
        out[k] += 1
    return out


def memory_aware_allocation(group: list[str], batch: int, time_of: Callable[[str, int], float],
                            max_batch: Callable[[str], int], block: int = 1) -> dict[str, int] | None:
    """Samples per device (in `group` order) for a micro-batch of `batch`, or None when the
    group's memory cannot hold it. `time_of(d, y)`: the stage's time on d for y samples;
    `max_batch(d)`: the most samples d can hold."""
    cap = {d: max(0, int(max_batch(d))) for d in group}
    if sum(cap.values()) < batch:
        return None
    y = {d: 0 for d in group}
    speed = {d: 1.0 / max(time_of(d, batch), 1e-12) for d in group}
    # Phase 1: proportional to capacity, capped by memory, recursively over the rest.
    active = [d for d in group if cap[d] > 0]
    left = batch
    while left > 0:
        shares = largest_remainder(left, {d: speed[d] for d in active})
        given = 0
        for d in active:
            take = min(shares[d], cap[d] - y[d])
            y[d] += take
            given += take
        left -= given
        active = [d for d in active if y[d] < cap[d]]
        if left > 0 and given == 0:  # rounding gave nothing to the devices with room
            d = max(active, key=lambda k: speed[k])
            y[d] += 1
            left -= 1
    # Phase 2: offload blocks from the straggler while the straggler gets faster.
    for _ in range(batch * len(group) + 1):
        times = {d: time_of(d, y[d]) for d in group}
        slow = max(group, key=lambda d: (times[d], -group.index(d)))
        move = min(block, y[slow])
        room = [d for d in group if d != slow and y[d] + move <= cap[d]]
        if move == 0 or not room:
            break
        fast = min(room, key=lambda d: (time_of(d, y[d] + move), group.index(d)))
        trial = dict(y)
        trial[slow] -= move
        trial[fast] += move
        if max(time_of(d, trial[d]) for d in group) < times[slow] - 1e-15:
            y = trial
        else:
            break
    return y


def group_time(group: list[str], alloc: dict[str, int], time_of: Callable[[str, int], float]) -> float:
    return max(time_of(d, alloc.get(d, 0)) for d in group)
