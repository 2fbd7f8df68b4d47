"""Running a whole Plan inside one process: every device a task, the network in memory.

Used by tests (plans checked against the local trainer with no sockets involved, devices
killed and brought back at chosen steps) and by `swarm train --in-process`, to try a plan
out on one machine.
"""
from __future__ import annotations

import math

import trio

from planner.baselines import simple_plan
from planner.plan import Plan
from swarm.errors import SwarmError, run_trio
from swarm.execution.channels import COORDINATOR
from swarm.execution.coordinator import RECOVERY_PHASES, TrainingCoordinator
from swarm.execution.endpoint import LocalNetwork
from swarm.execution.replay import DeviceStore, holding_missed
from swarm.execution.worker import DeviceWorker, JobSpec
from swarm.local.trainer import LocalTrainer


# a worker that fails waits this long for a loss that explains it (a new epoch cancels it),
# as RosterControl does for a part that failed on a device that is fine; then the run stops
FAILURE_GRACE_S = 10.0
# a phase event's loss is given this long to be noticed while its phase goes on
NOTICE_S = 0.05
# threads trio lends this process's other work (loading batches, copies), as its default
THREADS_BESIDE_COMPUTE = 40


class LocalControl:
    """Devices in this process with epochs: each epoch gets a fresh in-memory network (so
    nothing of an older epoch reaches a newer one); killing a device cancels its worker and
    forgets everything it held, as a power cut would. A dead device cannot take a part in a
    new epoch (as an assignment to it fails): its loss is reported again."""

    def __init__(self, devices: list[str], nursery: trio.Nursery):
        self.devices = list(devices)
        self.nursery = nursery
        self.stores = {d: DeviceStore() for d in devices}
        self.dead: set[str] = set()
        self.silent: set[str] = set()  # running, but not answering (no loss reported)
        self.scopes: dict[str, trio.CancelScope] = {}
        self._loss_send, self._loss_recv = trio.open_memory_channel(math.inf)
        self._join_send, self._join_recv = trio.open_memory_channel(math.inf)
        self.epochs_started = 0
        self.spares: dict[str, int] = {}  # what a device says it can spare (none: it says nothing)

    async def spare(self, devices: list[str]) -> dict[str, int]:
        return {d: self.spares[d] for d in devices if d in self.spares}

    def squeeze(self, device: str) -> None:
        """Another program on `device` takes its memory: it can spare 1 MiB."""
        self.spares[device] = 2**20

    @staticmethod
    def admit(joined: list[str], in_use: int) -> list[str]:
        return joined  # no device limit in process

    async def start_epoch(self, epoch: int, job: JobSpec):
        for scope in self.scopes.values():
            scope.cancel()
        self.scopes = {}
        self.epochs_started += 1
        # Every device of a gang holds a compute thread while it waits for the others at a
        # BatchNorm exchange: trio's default 40 threads would leave the rest of a group of 64
        # waiting for a thread, and the group for them. One thread per stage on each device,
        # beside the rest.
        threads = THREADS_BESIDE_COMPUTE + len(job.plan.stages) * len(job.plan.used_devices())
        limiter = trio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, threads)
        network = LocalNetwork()
        coordinator = network.endpoint(COORDINATOR)
        for d in job.plan.used_devices():
            if d in self.dead:
                self._loss_send.send_nowait({d})
                continue
            scope = trio.CancelScope()
            self.scopes[d] = scope
            self.nursery.start_soon(self._run, scope, DeviceWorker(network.endpoint(d), job, self.stores[d]))
        return coordinator

    async def _run(self, scope: trio.CancelScope, worker: DeviceWorker) -> None:
        with scope:
            try:
                await worker.run()
            except Exception as exc:  # noqa: BLE001 (one line, unless a new epoch makes it moot first)
                missed = holding_missed(exc)
                if missed is not None:  # a holding counted that is not there: lost, as the roster counts it
                    self._loss_send.send_nowait({missed.holder})
                    return
                await trio.sleep(FAILURE_GRACE_S)
                raise SwarmError(f"{worker.device} failed: {type(exc).__name__}: {exc}") from exc

    def kill(self, device: str) -> None:
        self.vanish(device)
        self._loss_send.send_nowait({device})

    def forget(self, device: str) -> None:
        """A device that goes on, but without the states it kept (as an agent started again
        that a recovery still counts as holding them)."""
        self.stores[device] = DeviceStore()

    def vanish(self, device: str) -> None:
        """A device that dies and whose loss is reported to no one (the news went astray):
        only gone() knows it, as a roster knows a device dead whatever was reported."""
        if device in self.scopes:
            self.scopes.pop(device).cancel()
        self.stores[device] = DeviceStore()
        self.dead.add(device)

    def revive(self, device: str) -> None:
        """A device that comes back (empty-handed) or a new one."""
        if device not in self.devices:
            self.devices.append(device)
            self.stores[device] = DeviceStore()
        self.dead.discard(device)
        self._join_send.send_nowait({device})

    def silence(self, device: str) -> None:
        """A device that goes on working but stops answering, as one whose heartbeats lapse on
        a busy machine: not alive, and never reported lost."""
        self.silent.add(device)

    def hear(self, device: str) -> None:
        self.silent.discard(device)

    def alive(self) -> list[str]:
        return [d for d in self.devices if d not in self.dead and d not in self.silent]

    def gone(self) -> set[str]:
        return set(self.dead)

    async def next_loss(self) -> set[str]:
        return await self._loss_recv.receive()

    async def next_join(self) -> set[str]:
        return await self._join_recv.receive()


def train_plan_in_process(plan: Plan, trainer: LocalTrainer, train_set, total_steps: int, *,
                          on_step=None, timeout_s: float = 300.0, events=(), backup_interval: int = 1,
                          strategy: str = "pp", devices: list[str] | None = None, log=lambda s: None,
                          recovery: str = "auto", recost=None, lease=None):
    """Train `trainer` (its weights are the start, and receive the result) to `total_steps`
    with `plan`, all devices in this process. `events` are (committed step,
    "kill"|"vanish"|"revive"|"silence"|"hear"|"squeeze", device, delay seconds): after that step
    commits, wait `delay`, then do it ("vanish": killed, and its loss reported to no one); or
    (phase, action, device, delay) with a phase of coordinator.RECOVERY_PHASES: the first time
    a recovery reaches that phase, wait `delay`, do it, and let the phase go on for NOTICE_S, so
    that the loss lands in that phase ("re-plan": while the re-plan's thread waits for it).
    `recovery` as `swarm train --recovery` says; `recost` and `lease` as TrainingCoordinator's.
    Returns the coordinator (its `recoveries` say what happened)."""
    plan.validate(trainer.desc)
    job = JobSpec(plan, trainer.cfg, trainer.cfg_text, timeout_s=timeout_s, backup_interval=backup_interval)
    pending = sorted(e for e in events if not isinstance(e[0], str))
    in_phases = [e for e in events if isinstance(e[0], str)]
    unknown = {e[0] for e in in_phases} - set(RECOVERY_PHASES)
    if unknown:
        raise ValueError(f"no recovery phase {', '.join(sorted(unknown))}; there are {', '.join(RECOVERY_PHASES)}")

    async def main():
        async with trio.open_nursery() as nursery:
            control = LocalControl(devices or plan.used_devices(), nursery)
            coordinator = TrainingCoordinator(control, job, trainer, train_set, strategy=strategy, log=log,
                                              recovery=recovery)
            coordinator.recost, coordinator.lease = recost, lease

            def stepped(report):
                if on_step is not None:
                    on_step(report)
                while pending and pending[0][0] <= report.step and not report.replayed:
                    _, action, device, delay = pending.pop(0)
                    nursery.start_soon(act, action, device, delay)

            async def act(action: str, device: str, delay: float) -> None:
                await trio.sleep(delay)
                getattr(control, action)(device)

            async def reached(phase: str) -> None:
                for event in [e for e in in_phases if e[0] == phase]:
                    in_phases.remove(event)
                    await act(*event[1:])
                    await trio.sleep(NOTICE_S)

            if in_phases:
                coordinator.phase_hook = reached
            await coordinator.run(total_steps, stepped)
            nursery.cancel_scope.cancel()
            return coordinator

    return run_trio(main)


class InProcessRunner:
    """run_steps for swarm.local.trainer.train: a simple plan over `devices` pretend devices, all
    in this process (to try a strategy out, or check it against --strategy local)."""

    def __init__(self, strategy: str, devices: int, grid=None, sync=None, stages=None, log=print):
        self.strategy, self.devices = strategy, devices
        self.grid, self.sync, self.stages, self.log = grid, sync, stages, log

    def __call__(self, trainer, train_set, start: int, total: int, report) -> None:
        cfg = trainer.cfg
        names = [f"dev{i}" for i in range(self.devices)]
        plan = simple_plan(self.strategy, trainer.desc, names, cfg.batch_size, cfg.microbatches, grid=self.grid,
                           sync=self.sync, stages=self.stages)
        self.log(plan.describe() + "\n  (all devices in this process)")

        def on_step(r):
            report(r.step, r.loss, cfg.batch_size, r.seconds)

        train_plan_in_process(plan, trainer, train_set, total, on_step=on_step, strategy=self.strategy, log=self.log)
