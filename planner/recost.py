"""Plans that correct themselves from what the devices measure (pure).

A plan is only as good as the profiles it was costed with, and a profile is a few timed
passes taken once: devices that profiled side by side on a busy host, a Pi that throttles
once it is warm, a background job on a laptop all make a device slower or faster in training
than its profile says. After a run's first steps every device reports how long its own
compute took (busy time less the time it waited inside it for its group's BatchNorm sums).
`recost` sets that against what the cost model gives the same plan, scales each device's cost
table by the ratio (a device that did not take part by the median ratio of those that did,
since they were profiled alike), and plans again on the corrected devices. The run switches
(at its next backup step, like a device that joins: coordinator.TrainingCoordinator) only
when the new plan is predicted at least RECOST_GAIN faster than the running one on the same
corrected devices, so that a noisy measure does not move the work back and forth, and only
where what it saves over the steps left pays for the switch (SWITCH_STEPS).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from planner.cluster import Cluster
from planner.inputs import PlanInputs
from planner.plan import Plan, PlanError
from planner.simulator import simulate

RECOST_GAIN = 0.10  # switch for a plan predicted at least this much faster (of the step time)
RATIO_BOUNDS = (0.25, 4.0)  # a measure further off than this is a stall, not a speed
# A device whose own compute is under this share of the busiest device's is not measured by it:
# its few milliseconds (a classifier's last pooling and softmax, say) are mostly each
# operation's fixed cost: one read 0.49x on the testbed, and the plan that then gave its device
# six layers ran far slower than predicted (bench/RESULTS.md, 2026-11-30 20:11 UTC). It takes
# the median of the others' ratios.
MEASURED_SHARE = 0.1
# A switch is paid for with the new plan's first step, which moves layers, refills the pipeline
# and allocates afresh: on the testbed it took 3.6x the step predicted for it (15.9 s against
# 4.4). A re-costed plan is taken only where it saves more than this many of its steps over
# the steps left after the switch.
SWITCH_STEPS = 2.0


def own_compute(plan: Plan, cluster: Cluster) -> dict[str, float] | None:
    """Seconds of its own compute each device of `plan` spends a step by the cost tables:
    the forward and backward of its samples of each micro-batch it takes, the loss on the
    last stage, the optimizer step. None for a plan with tiles (a tile's share of a layer is
    not a sample's)."""
    if any(s.mode == "tiles" for s in plan.stages):
        return None
    mb = plan.batch_size // plan.microbatches
    last = len(plan.stages) - 1
    own: dict[str, float] = {}
    for p, s in enumerate(plan.stages):
        shares = s.replica_shares(plan.microbatches)
        for r in range(s.replica_count()):
            for d in s.replica_devices(r):
                costs = cluster.device(d).costs
                samples = s.allocation[d] if s.mode == "dp" else mb
                per_mb = costs.fwd_range(s.first, s.last, samples) + costs.bwd_range(s.first, s.last, samples)
                if p == last and samples:
                    per_mb += sum(costs.loss_time(samples))
                own[d] = own.get(d, 0.0) + shares[r] * per_mb + costs.update_range(s.first, s.last)
    return own


def speed_ratios(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """measured / predicted own compute per device that has both, within RATIO_BOUNDS, for
    the devices predicted at least MEASURED_SHARE of the busiest one's compute."""
    lo, hi = RATIO_BOUNDS
    floor = MEASURED_SHARE * max(predicted.values(), default=0.0)
    return {d: min(hi, max(lo, measured[d] / predicted[d])) for d in predicted
            if predicted[d] > 0 and predicted[d] >= floor and measured.get(d, 0.0) > 0}


def corrected(cluster: Cluster, ratios: dict[str, float]) -> Cluster:
    """`cluster` with each device's times multiplied by its ratio; the devices without one by
    the median of the others'."""
    if not ratios:
        return cluster
    typical = statistics.median(ratios.values())
    devices = [replace(d, costs=d.costs.scaled(1.0 / ratios.get(d.name, typical))) for d in cluster.devices]
    return replace(cluster, devices=devices)


@dataclass
class Recost:
    ratios: dict[str, float]  # measured / predicted own compute, per device that ran
    current_s: float  # the running plan's step on the corrected devices
    plan: Plan | None  # the plan to switch to, or None to keep the running one
    new_s: float | None = None  # its predicted step

    def pays(self, steps_left: int) -> bool:
        """Whether switching to `plan` with `steps_left` steps to run after the switch saves
        more than the switch costs (SWITCH_STEPS of the new plan's steps)."""
        if self.plan is None or self.new_s is None:
            return False
        return (self.current_s - self.new_s) * steps_left > SWITCH_STEPS * self.new_s

    def describe(self) -> str:
        speeds = ", ".join(f"{d} {r:.2f}x" for d, r in sorted(self.ratios.items()))
        head = f"measured compute against the profiles: {speeds}; the running plan costs {self.current_s:.1f} s a step"
        if self.plan is None:
            return head + (f", a new one {self.new_s:.1f} s: keeping it" if self.new_s is not None else ": keeping it")
        return head + f", a new one {self.new_s:.1f} s"


def recost(plan: Plan, inputs: PlanInputs, measured: dict[str, float], alive: list[str],
           planner: str = "auto") -> Recost | None:
    """Correct the devices' costs by `measured` (seconds of own compute a step, per device of
    `plan`) and plan again over the `alive` devices; None when the plan cannot be costed so
    (tiles, or nothing measured)."""
    from planner.planners import make_plan

    predicted = own_compute(plan, inputs.cluster)
    if predicted is None:
        return None
    ratios = speed_ratios(predicted, measured)
    if not ratios:
        return None
    cluster = corrected(inputs.cluster.subset([d for d in inputs.cluster.names if d in alive]), ratios)
    fixed = replace(inputs, cluster=cluster)
    current = simulate(plan, inputs.desc, inputs.mem, cluster).step_time
    try:
        new = make_plan(planner, fixed)
    except PlanError:
        return Recost(ratios, current, None)
    new_s = float(new.predicted["step_time_s"])
    if not new.predicted.get("fits", True) or new_s > current * (1.0 - RECOST_GAIN):
        return Recost(ratios, current, None, new_s)
    return Recost(ratios, current, new, new_s)
