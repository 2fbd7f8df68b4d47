"""Running a whole Plan inside one process: every device a task, the network in memory.

Used by tests (plans checked against the local trainer with no sockets involved) and by
`swarm train --in-process` for a plan, to try a plan out on one machine.
"""
from __future__ import annotations

import trio

from planner.plan import Plan
from swarm.execution.coordinator import TrainingCoordinator
from swarm.execution.endpoint import LocalNetwork
from swarm.execution.routing import Layout
from swarm.execution.tiling import TileGeometry
from swarm.execution.worker import COORDINATOR, DeviceWorker, JobSpec
from swarm.trainer import LocalTrainer


def train_plan_in_process(plan: Plan, trainer: LocalTrainer, train_set, total_steps: int, *,
                          on_step=None, timeout_s: float = 300.0) -> LocalTrainer:
    """Train `trainer` (its weights are the start, and receive the result) to `total_steps`
    with `plan`, all devices in this process."""
    plan.validate(trainer.desc)
    job = JobSpec(plan, trainer.cfg, trainer.cfg_text, timeout_s=timeout_s)
    network = LocalNetwork()
    coordinator = TrainingCoordinator(network.endpoint(COORDINATOR), job, trainer, train_set,
                                      Layout(plan, trainer.desc, TileGeometry(plan, trainer.desc)))
    workers = [DeviceWorker(network.endpoint(device), job) for device in plan.used_devices()]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(worker.run)
            await coordinator.run(total_steps, on_step)

    trio.run(main)
    return trainer


class InProcessRunner:
    """run_steps for swarm.trainer.train: a simple plan over `devices` pretend devices, all
    in this process (to try a strategy out, or check it against --strategy local)."""

    def __init__(self, strategy: str, devices: int, grid=None, sync=None, stages=None, log=print):
        self.strategy, self.devices = strategy, devices
        self.grid, self.sync, self.stages, self.log = grid, sync, stages, log

    def __call__(self, trainer, train_set, start: int, total: int, report) -> None:
        from swarm.execution.strategies import simple_plan
        from swarm.execution.swarm_train import describe_plan

        cfg = trainer.cfg
        names = [f"dev{i}" for i in range(self.devices)]
        plan = simple_plan(self.strategy, trainer.desc, names, cfg.batch_size, cfg.microbatches, grid=self.grid,
                           sync=self.sync, stages=self.stages)
        self.log(describe_plan(plan) + "\n  (all devices in this process)")

        def on_step(r):
            report(r.step, r.loss, cfg.batch_size, r.seconds)

        train_plan_in_process(plan, trainer, train_set, total, on_step=on_step)
