"""The simple planners every other one is measured against: local, dp and pp.

- local: the whole model on one device (the data source, else the fastest device).
- dp: the whole model on every device, each micro-batch dealt out by Asteroid's Alg. 1
  (speed-proportional, memory-aware); devices left with no samples are dropped.
- pp: GPipe — one stage per device in the cluster's order, layers split so the stages take
  equal time on an average device, every stage warming up with all M forwards.
"""
from __future__ import annotations

import numpy as np

from planner.allocation import memory_aware_allocation
from planner.inputs import NoPlan, PlanInputs
from planner.plan import Plan, Stage, most_replicas


def plan_local(inputs: PlanInputs, device: str | None = None) -> Plan:
    cluster = inputs.cluster
    name = device or cluster.data_source or cluster.by_speed(inputs.microbatch)[0]
    plan = inputs.plan([Stage(0, inputs.num_layers, "single", [name])], "local")
    return inputs.finish(plan)


def dp_allocation(inputs: PlanInputs, group: list[str], first: int, last: int, warmup: int,
                  budgets: dict[str, float] | None = None) -> dict[str, int] | None:
    """Alg. 1 for layers [first, last) over `group` (None: the group's memory is too small)."""
    cluster, mem = inputs.cluster, inputs.mem
    with_loss = last == inputs.num_layers
    budgets = budgets or {d: cluster.device(d).memory for d in group}

    def time_of(d: str, y: int) -> float:
        return cluster.device(d).costs.range_time(first, last, y, with_loss) if y else 0.0

    def max_batch(d: str) -> int:
        return mem.max_batch(first, last, warmup, budgets[d])

    return memory_aware_allocation(group, inputs.microbatch, time_of, max_batch, block=max(1, inputs.microbatch // 16))


def plan_dp(inputs: PlanInputs) -> Plan:
    if inputs.batch_size % inputs.microbatches:
        raise NoPlan(f"data parallelism needs the batch ({inputs.batch_size}) to split evenly into "
                     f"{inputs.microbatches} micro-batches")
    group = inputs.cluster.by_speed(inputs.microbatch)
    alloc = dp_allocation(inputs, group, 0, inputs.num_layers, 1)
    if alloc is None:  # memory too small even together: deal by speed alone and report the overflow
        alloc = memory_aware_allocation(group, inputs.microbatch, lambda d, y: inputs.cluster.reference_time(d, max(y, 1)) * y,
                                        lambda d: inputs.microbatch)
    alloc = {d: y for d, y in alloc.items() if y > 0}
    mode = "dp" if len(alloc) > 1 else "single"
    stage = Stage(0, inputs.num_layers, mode, list(alloc), allocation=alloc if mode == "dp" else None)
    shared = inputs.finish(inputs.plan([stage], "dp"))
    copies = most_replicas(inputs.microbatches, len(group))
    if copies <= len(alloc):
        return shared
    # whole micro-batches per device keep more devices busy: the fastest that many, the
    # slowest first (the simulator times the first replica)
    chosen = list(reversed(group[:copies]))
    replicated = inputs.finish(inputs.plan([Stage(0, inputs.num_layers, "single", chosen, replicas=copies)], "dp"))
    return min((replicated, shared), key=lambda p: (not p.predicted["fits"], p.predicted["step_time_s"]))


def balanced_split(layer_times: np.ndarray, parts: int) -> list[int]:
    """Boundaries [0, b1, ..., L] of `parts` contiguous blocks minimising the largest block's
    time (the linear-partition dynamic program)."""
    n = len(layer_times)
    parts = max(1, min(parts, n))
    cum = np.concatenate([[0.0], np.cumsum(layer_times)])
    best = np.full((parts + 1, n + 1), np.inf)
    cut = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            i = np.arange(k - 1, j)
            cost = np.maximum(best[k - 1, i], cum[j] - cum[i])
            a = int(np.argmin(cost))
            best[k, j], cut[k, j] = cost[a], i[a]
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(int(cut[k, bounds[-1]]))
    return bounds[::-1]


def plan_pp(inputs: PlanInputs) -> Plan:
    cluster = inputs.cluster
    names = cluster.names
    parts = min(len(names), inputs.num_layers)
    mb = inputs.microbatch
    times = np.mean([[d.costs.range_time(i, i + 1, mb) for i in range(inputs.num_layers)] for d in cluster.devices], axis=0)
    bounds = balanced_split(times, parts)
    stages = [Stage(a, b, "single", [names[k]], warmup=inputs.microbatches)
              for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return inputs.finish(inputs.plan(stages, "pp"))
