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
