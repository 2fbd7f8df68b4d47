"""What every planner reads: the model, its memory model, the cluster, batch and micro-batches.

    inputs = PlanInputs(desc, MemoryModel.estimated(desc), cluster, batch_size=16, microbatches=4)
    plan = PLANNERS["asteroid"](inputs)          # a Plan with `predicted` filled in
    timeline = inputs.simulate(plan)
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.cluster import Cluster
from planner.memory import MemoryModel
from planner.model_desc import ModelDesc
from planner.plan import Plan, PlanError, Stage
from planner.simulator import Timeline, backups_with_room, simulate


class NoPlan(PlanError):
    """A planner found no plan for these inputs (the message says why)."""


@dataclass
class PlanInputs:
    desc: ModelDesc
    mem: MemoryModel
    cluster: Cluster
    batch_size: int
    microbatches: int = 1

    def __post_init__(self):
        if self.batch_size < 1:
            raise PlanError(f"the batch size must be at least 1, got {self.batch_size}")
        if not 1 <= self.microbatches <= self.batch_size:
            raise PlanError(f"--microbatches must be between 1 and the batch size ({self.batch_size}), "
                            f"got {self.microbatches}")
        if self.mem.desc is not self.desc and len(self.mem.desc.layers) != len(self.desc.layers):
            raise PlanError("the memory model describes another model")
        for d in self.cluster.devices:
            if d.costs.num_layers != len(self.desc.layers):
                raise PlanError(f"device {d.name} has costs for {d.costs.num_layers} layers; "
                                f"{self.desc.name} has {len(self.desc.layers)}")

    @property
    def num_layers(self) -> int:
        return len(self.desc.layers)

    @property
    def microbatch(self) -> int:
        """Samples per micro-batch (dp stages need the batch to split evenly)."""
        return self.batch_size // self.microbatches

    def plan(self, stages: list[Stage], planner: str, microbatches: int | None = None) -> Plan:
        """A Plan over these inputs, with the devices it uses described."""
        used = {d for s in stages for d in s.devices}
        devices = {name: facts for name, facts in self.cluster.describe().items() if name in used}
        return Plan(model=self.desc.name, img_size=self.desc.img_size, batch_size=self.batch_size,
                    microbatches=microbatches or self.microbatches, stages=stages, devices=devices, planner=planner)

    def simulate(self, plan: Plan) -> Timeline:
        """The plan's timeline. Where the backups the pipeline's order gives (backup_holders)
        leave a device short of memory, and holders chosen for room fit, the plan takes
        those (plan.backups, which the run keeps)."""
        timeline = simulate(plan, self.desc, self.mem, self.cluster)
        if timeline.fits or plan.backups or not self.mem.kept:
            return timeline
        roomy = Plan.from_dict(plan.to_dict())
        roomy.backups = backups_with_room(plan, self.mem, timeline)
        if not roomy.backups:
            return timeline
        trial = simulate(roomy, self.desc, self.mem, self.cluster)
        if trial.fits:
            plan.backups = roomy.backups
            return trial
        return timeline

    def finish(self, plan: Plan) -> Plan:
        """Simulate the plan and record the prediction in it, with its gradient sums in the
        order that starts each step soonest (with_sum_orders); or the same plan with its
        gangs overlapping, where that is better (with_overlap)."""
        timeline = self.simulate(plan)
        plan.predicted = timeline.summary()
        return self.with_overlap(self.with_sum_orders(plan, timeline))

    def with_sum_orders(self, plan: Plan, timeline: Timeline | None = None) -> Plan:
        """`plan` with each single or dp stage that sums over several devices summing its
        buckets in the order its times favour (Timeline.best_sum_orders: what the next
        forward needs first, where the backward has made it final), its prediction made
        again; the plan as it was where no order is faster."""
        timeline = timeline or self.simulate(plan)
        orders = {p: order for p, order in timeline.best_sum_orders().items()
                  if order != (plan.stages[p].sum_order or sorted(order, reverse=True))}
        if not orders:
            return plan
        trial = Plan.from_dict(plan.to_dict())
        for p, order in orders.items():
            trial.stages[p].sum_order = None if order == sorted(order, reverse=True) else order
        other = self.simulate(trial)
        if not other.fits and timeline.fits or other.step_time >= timeline.step_time:
            return plan
        trial.predicted = {**(plan.predicted or {}), **other.summary()}
        return trial

    def with_overlap(self, plan: Plan) -> Plan:
        """`plan`, or the same plan with its gangs overlapping each backward with the next
        forward (Stage.overlap) where that is predicted faster and fits: it hides their
        BatchNorm waits behind computation, for one more micro-batch of activations during
        each backward."""
        stages = [p for p in gangs(plan, self.desc) if not plan.stages[p].overlap]
        if not stages or not plan.predicted:
            return plan
        trial = Plan.from_dict(plan.to_dict())
        for p in stages:
            trial.stages[p].overlap = True
        timeline = self.simulate(trial)
        if not timeline.fits or timeline.step_time >= plan.predicted["step_time_s"]:
            return plan
        trial.predicted = {**plan.predicted, **timeline.summary()}
        return trial


def gangs(plan: Plan, desc: ModelDesc) -> list[int]:
    """The dp stages whose devices share micro-batches over BatchNorm layers: every device of
    a group waits at each of them for the group's sums."""
    return [p for p, s in enumerate(plan.stages)
            if s.mode == "dp" and any(desc.layers[i].batch_normalize for i in s.layers)
            and any(len(s.replica_devices(r)) > 1 for r in range(s.replica_count()))]
