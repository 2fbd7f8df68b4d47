"""The coordinator's side of a training job: start each epoch's plan on its devices, feed
each step's samples (uint8 images to the first stage, targets to the last), commit a step
when every device is ready, and when a device is lost, roll every stage back to the last
complete backup, re-plan over the survivors, and replay (the mechanics: replay.py).

Devices are reached through a `control` (launch.RosterControl over the swarm's roster, or
inprocess.LocalControl for devices in this process):

    endpoint = await control.start_epoch(epoch, job)   # (re)start every device of job.plan
    lost = await control.next_loss()                    # names of devices that died or failed
    control.gone()                                      # names of the devices known dead now
    control.alive()                                     # names of the devices that answer now

No wait without a watch: for the whole run, in every phase (the steps, and each phase of a
recovery: roll-back, re-plan, migration, replay), a watch takes the control's news of lost
devices (and looks at what it knows dead, in case news went astray) and cancels the phase
under way when a device it depends on is among them. Whatever that phase waited for (a
device's ready, a backup, the layers of a migration, an assignment) ends there, and the next
recovery starts from what the cancelled one left, without the devices lost meanwhile. A run
that cannot go on ends with one line (a SwarmError) saying why and where its checkpoint is.

What it sends and receives, and the keys, are in channels.py.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import trio

from planner.backups import Move, backup_holders, layer_sources
from planner.memory_fit import room_left
from planner.plan import Plan, PlanError
from planner.replan import replan
from planner.routing import Block, Layout, runs, stage_parts
from swarm.data import class_targets, microbatch_bounds, training_batch
from swarm.errors import SwarmError
from swarm.execution import channels
from swarm.execution.blocks import cut
from swarm.execution.channels import COORDINATOR
from swarm.execution.halos import TileGeometry
from swarm.execution.replay import BackupLedger, Recovery, from_coordinator
from swarm.execution.worker import JobSpec
from swarm.local.trainer import LocalTrainer, set_lr

# a plan the cost model made is set against the devices' measure once an epoch has committed
# this many steps (the first carries one-off costs: first-touch memory, kernels' set-up)
RECOST_AFTER = 2
# a device of the plan found not alive when another's loss is recovered from (its heartbeats
# lapsed on a busy machine, its probe went unanswered) gets this long to be heard from again
# before a coordinator left with no other device of its plan gives the run up
PRESUMED_GRACE_S = 5.0
# the loss watch also looks this often at the devices the control knows dead (control.gone()),
# so that a loss whose news went astray still ends the waits on that device
GONE_POLL_S = 0.5
LEASE_POLL_S = 0.05  # how often a replicated run looks at its lease (swarm/agent/quorum.py)
# the phases of a recovery, as phase_hook hears of them (tests use it to lose a device in each)
RECOVERY_PHASES = ("roll-back", "re-plan", "migration", "replay")


@dataclass
class StepReport:
    step: int  # 1-based count of finished steps
    loss: float
    seconds: float
    busy_s: dict[str, float] = field(default_factory=dict)
    times: dict[str, dict] = field(default_factory=dict)  # per device: schedule, reduce and wait seconds
    epoch: int = 0
    replayed: bool = False  # a step run again after a recovery
    backup: bool = False  # the devices back up what it committed (before the next step, settled)


def optimizer_slots(trainer: LocalTrainer) -> dict[str, torch.Tensor]:
    """The local optimizer's per-parameter state as {"param name|slot": tensor}."""
    by_param = {id(p): n for n, p in trainer.net.named_parameters()}
    out = {}
    for param, st in trainer.optimizer.state.items():
        for slot, v in st.items():
            if torch.is_tensor(v):
                out[f"{by_param[id(param)]}|{slot}"] = v
    return out


def load_states(trainer: LocalTrainer, states: dict[str, torch.Tensor]) -> None:
    """Weights, buffers and optimizer slots (as workers send them) into the whole model."""
    model = {k: v for k, v in states.items() if "|" not in k}
    full = dict(trainer.net.state_dict())
    full.update(model)
    trainer.net.load_state_dict(full)
    params = dict(trainer.net.named_parameters())
    for key, value in states.items():
        if "|" in key:
            name, slot = key.split("|", 1)
            trainer.optimizer.state[params[name]][slot] = value.clone()


class DeviceLost(Exception):
    def __init__(self, devices: set[str]):
        super().__init__(", ".join(sorted(devices)))
        self.devices = devices


class TrainingCoordinator:
    def __init__(self, control, job: JobSpec, trainer: LocalTrainer, train_set, *, strategy: str = "pp",
                 checkpoint_every: int = 0, save_hook=None, log=print, max_recoveries: int = 16,
                 recovery: str = "auto"):
        self.control = control
        self.job = job
        self.plan = job.plan
        self.trainer = trainer  # holds the whole model: the start, and the end result
        self.train_set = train_set
        self.strategy = strategy  # for heavy re-planning
        self.checkpoint_every = checkpoint_every
        self.save_hook = save_hook  # called after the trainer received a checkpoint's weights
        self.log = log
        self.max_recoveries = max_recoveries  # in a row without getting past the furthest step reached
        self.furthest = trainer.step_count  # the most steps ever committed
        self.recoveries_in_a_row = 0  # losses since `furthest` last moved
        # auto: shift the plan when that is nearly as good as a fresh one; light: always shift;
        # heavy: stop, plan again, and reload the last checkpoint (the coordinator's copy)
        self.recovery = recovery
        self.committed = trainer.step_count  # steps applied on every device
        self.should_stop = lambda: False  # asked after every commit: end the run there?
        self.stopped_early = False
        self.epoch = job.epoch
        self.ep = None
        self.layout: Layout | None = None
        # what is where: the coordinator's own weights, and complete backups on the devices
        self.own_step = trainer.step_count
        self.backups = BackupLedger(job.backup_interval)
        self.recoveries: list[Recovery] = []
        self.replay_until = 0  # steps below this are being run again
        self.joined: set[str] = set()  # devices that (re)appeared and may be taken in
        self.replicate = None  # async (): the state a successor needs, sent to the agents (failover.py)
        self.own_device: str | None = None  # the device of this coordinator's own agent (a replicated run's)
        # (plan, {device: seconds of own compute a step}, alive devices) -> planner.recost.Recost | None:
        # set for plans the cost model made; asked once an epoch has run RECOST_AFTER steps
        self.recost = None
        self.epoch_steps = 0  # steps committed in this epoch
        self.recost_epochs: set[int] = set()  # epochs started by a re-costed plan (not costed again)
        self.better = None  # a planner.recost.Recost whose plan waits for a backup step
        self.feed_failure: Exception | None = None  # why samples sent ahead could not go (_feed_ahead)
        self.feed_waits_for: tuple[str, int] | None = None  # (device, step) whose sums they wait for
        # the loss watch (_watch_losses): the devices the phase under way depends on, the phase
        # (a cancel scope), the losses that cancelled it, and the devices the recovery under way
        # has already written off (the next one leaves them out too, if this one is cut short)
        self.watched: set[str] = set()
        self.phase: trio.CancelScope | None = None
        self.news: set[str] = set()
        self.recovering: set[str] = set()
        # tests: async (phase) -> None, awaited as a recovery reaches each of RECOVERY_PHASES
        # (for "re-plan", from inside the re-plan's thread, while it runs); None in a real run
        self.phase_hook = None
        self.checkpoint_path: str | None = None  # where save_hook writes (named when a run gives up)
        # a replicated run's quorum.Lease: no step commits without it, and the run stops once it
        # is lost for good (swarm/agent/quorum.py)
        self.lease = None
        self.lease_lost: SwarmError | None = None

    def take_over(self, epoch: int, step: int, holdings: dict[str, set[int]]) -> None:
        """Carry on a run whose coordinator was lost: its newest complete backup is at `step`,
        `holdings` says who holds which layers there, and `epoch` is the first of this term."""
        self.epoch = epoch - 1  # recover() starts the next epoch
        self.committed = self.furthest = step
        self.backups.step, self.backups.holdings = (step, holdings) if holdings else (None, {})

    # ---- epochs ------------------------------------------------------------------------
    async def start_epoch(self, plan: Plan, start: int, moves: list[Move]) -> None:
        """Start `plan` on its devices from committed step `start`."""
        plan.backups = plan.backups or backup_holders(plan)
        self.plan = plan
        self.recovering, self.watched = set(), set(plan.used_devices())
        self.epoch_steps, self.better = 0, None
        self.job = replace(self.job, plan=plan, epoch=self.epoch, start_step=start, moves=moves)
        self.layout = Layout(plan, self.trainer.desc, TileGeometry(plan, self.trainer.desc))
        self.backups.epoch_started(start, plan.used_devices())
        self.ep = await self.control.start_epoch(self.epoch, self.job)
        if self.replicate is not None:
            await self.replicate()
        own = [m for m in moves if m.src == COORDINATOR]
        if own:
            states = await trio.to_thread.run_sync(self._own_states)
            for m in own:
                wanted = set(m.layers)
                piece = {k: v for k, v in states.items() if int(k.split("|")[0].split(".")[1]) in wanted}
                await self.ep.send(m.dst, channels.layers(m.stage, COORDINATOR), {"states": piece})

    def _own_states(self) -> dict[str, torch.Tensor]:
        states = {k: v.detach().clone() for k, v in self.trainer.net.state_dict().items()}
        states.update({k: v.clone() for k, v in optimizer_slots(self.trainer).items()})
        return states

    # ---- data --------------------------------------------------------------------------
    async def get(self, key):
        """A device's message (ready, state: the device is the key's last element). A lost
        device ends the wait through the loss watch; one that still counts as alive and does not
        answer within the job's timeout ends the run, in one line."""
        try:
            return await self.ep.mailbox.get(key, self.job.timeout_s)
        except trio.TooSlowError:
            raise self.give_up(f"{key[-1]} sent no {key[0]} for step {key[1] + 1} within {self.job.timeout_s:g} s, "
                               f"yet still counts as alive") from None

    def give_up(self, why: str) -> SwarmError:
        """The one line a run that cannot go on ends with: why, and where it can be taken up."""
        where = ""
        if self.checkpoint_path and os.path.exists(self.checkpoint_path):
            where = (f"; its checkpoint (step {self.own_step}) is {self.checkpoint_path}: `swarm train --resume "
                     f"{self.checkpoint_path}` carries it on")
        return SwarmError(f"{why}; training stopped after step {self.furthest}{where}")

    def load_batch(self, step: int):
        return training_batch(self.trainer, self.train_set, step)

    async def feed(self, step: int, batch) -> None:
        images, targets = batch
        images = torch.from_numpy(images)
        if self.trainer.desc.detects:
            targets = torch.from_numpy(targets)
        else:
            targets = torch.from_numpy(class_targets(targets))
        last = len(self.plan.stages) - 1
        for m, (lo, hi) in enumerate(microbatch_bounds(self.plan.batch_size, self.plan.microbatches)):
            mb = hi - lo
            whole = Block((0, mb))
            for holding in self.layout.inputs(0, mb):
                if not runs(self.plan, holding.part, m):
                    continue
                block = cut(images[lo:hi], whole, holding.block).contiguous()
                await self.ep.send(holding.part.device, channels.feed(step, holding.part.index, m), {"arrays": [block]})
            for holding in self.layout.outputs(last, mb):
                if not runs(self.plan, holding.part, m):
                    continue
                s0, s1 = holding.block.samples
                await self.ep.send(holding.part.device, channels.targets(step, holding.part.index, m),
                                   {"arrays": [targets[lo + s0:lo + s1].contiguous()]})

    # ---- the run -----------------------------------------------------------------------
    async def run(self, total_steps: int, on_step=None, lost: set[str] | None = None) -> None:
        """Train from the trainer's step to `total_steps` (or until asked to stop), surviving
        lost devices; then collect the weights into the trainer. `lost`: the run is taken over
        from a lost coordinator (take_over): first recover without these devices."""
        failure: SwarmError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_losses)
            nursery.start_soon(self._watch_joins)
            nursery.start_soon(self._watch_lease, nursery.cancel_scope)
            try:
                await self._phases(total_steps, on_step, lost)
            except SwarmError as exc:  # raised as itself, not in an exception group
                failure = exc
            nursery.cancel_scope.cancel()
        failure = failure or self.lease_lost
        if failure is not None:
            raise failure

    async def _watch_lease(self, run: trio.CancelScope) -> None:
        """Stop the whole run, in any phase, once its lease (taken at its first epoch's start,
        if it has one) is lost for good."""
        while self.lease is None or not self.lease.must_stop(trio.current_time()):
            await trio.sleep(LEASE_POLL_S)
        self.lease_lost = self.give_up(self.lease.why(trio.current_time(), self.own_step))
        run.cancel()

    async def _may_commit(self) -> None:
        """Wait, if need be, until the lease lets this coordinator commit (the watch above ends
        the run if it never does)."""
        while self.lease is not None and not self.lease.may_commit(trio.current_time()):
            await trio.sleep(LEASE_POLL_S)

    async def _phases(self, total_steps: int, on_step, lost: set[str] | None) -> None:
        """Start (or recover), then the steps; a loss the watch reports cancels whichever is
        under way, and the next recovery goes on from there."""
        while True:
            self.news = set()
            self.phase = trio.CancelScope()
            with self.phase:
                if lost is None:
                    await self.start_epoch(self.plan, self.committed,
                                           from_coordinator(self.plan, self.committed, len(self.trainer.desc.layers)))
                else:
                    await self.recover(lost)
                await self._steps(total_steps, on_step)
            cancelled, self.phase = self.phase.cancelled_caught, None
            if not cancelled:
                break
            lost = self.recovering | self.news  # a recovery cut short: its losses, and the new ones
            if self.should_stop():  # asked to stop: not worth a re-plan; the last weights collected stand
                self.log(f"lost {', '.join(sorted(lost))} while stopping; stopping at step {self.own_step}, the "
                         f"last one whose weights were collected")
                self.stopped_early = True
                break
        self.watched = set()

    async def _watch_losses(self) -> None:
        """For the whole run: a device the phase under way depends on that the control reports
        lost, or knows dead, cancels that phase (a loss reported twice, or of a device no longer
        in the plan, is news to no one)."""
        while True:
            with trio.move_on_after(GONE_POLL_S):
                self._lost(await self.control.next_loss())
            self._lost(self.control.gone())

    def _lost(self, devices: set[str]) -> None:
        news = set(devices) & self.watched
        if news:
            self.news |= news
            self.watched -= news
            if self.phase is not None:
                self.phase.cancel()

    async def _reached(self, phase: str) -> None:
        if self.phase_hook is not None:
            await self.phase_hook(phase)

    async def _watch_joins(self) -> None:
        while True:
            self.joined |= await self.control.next_join()

    async def _steps(self, total_steps: int, on_step) -> None:
        """The epoch's steps. Each step's samples go out while the step before it runs (its
        devices hold one step of input ahead), so that no device waits at a step's start for
        its share to cross the link after the others'. They go out in the background
        (_feed_ahead), once the devices' sums of the step before that are done: while those
        sums travel, the devices' links are theirs."""
        failure: Exception | None = None
        self.feed_failure, self.feed_waits_for = None, None
        async with trio.open_nursery() as nursery:
            try:
                await self._step_loop(total_steps, on_step, nursery)
            except Exception as exc:  # raised as itself, not in the nursery's exception group
                failure = exc
            nursery.cancel_scope.cancel()  # a feed still waiting (the run stopped early) is not needed
        failure = failure or self.feed_failure
        if failure is not None:
            raise failure

    async def _feed_ahead(self, step: int, batch, done: trio.Event, nursery: trio.Nursery) -> None:
        """Send `step`'s samples once every device's sums of step - 2 are done (at once if the
        devices did not run step - 2 in this epoch). They are sent while step - 1 runs; step
        - 2's sums run then too (worker.py, Tail), on the same links, in the first part of
        step - 1, and the next step's forward waits for them layer by layer. A sender whose
        own link carries those sums (the coordinator beside a device of the plan) waits for
        them too. The wait has no time limit of its own: a device that never ends its sums never
        reports the next step ready either, and that wait ends the run, in one line."""
        try:
            if step - 2 >= self.job.start_step:
                for device in self.plan.used_devices():
                    self.feed_waits_for = (device, step - 2)
                    await self.ep.mailbox.get(channels.summed(step - 2, device))
            self.feed_waits_for = None
            await self.feed(step, batch)
        except Exception as exc:  # ends the steps, and _steps raises it
            self.feed_failure = self.feed_failure or exc
            nursery.cancel_scope.cancel()
        finally:
            done.set()

    async def _fed_ahead(self, ahead: trio.Event) -> None:
        """Wait until the samples sent ahead are out (before the plan may change); a device
        that does not end its sums within the job's timeout ends the run."""
        with trio.move_on_after(self.job.timeout_s):
            await ahead.wait()
        if not ahead.is_set():
            device, step = self.feed_waits_for or ("a device", self.committed - 1)
            raise self.give_up(f"{device} did not finish its gradient sums of step {step + 1} within "
                               f"{self.job.timeout_s:g} s, yet still counts as alive")

    async def _step_loop(self, total_steps: int, on_step, nursery: trio.Nursery) -> None:
        step = self.committed
        fed = -1  # the step whose samples are out (or on their way: `ahead` is set once they are out)
        ahead = trio.Event()
        ahead.set()
        next_batch = await trio.to_thread.run_sync(self.load_batch, step) if step < total_steps else None
        # A step's time runs from the commit of the one before it: what the coordinator does
        # between commits (re-costing, a checkpoint, a switch of plans) is the run's time too,
        # while the devices work on the step whose samples they already hold.
        since = None
        while step < total_steps:
            self.backups.step_begins(step)
            t0 = time.monotonic() if since is None else since
            if fed != step:
                await self.feed(step, next_batch)
                fed = step
            if step + 1 < total_steps and not self.should_stop():
                next_batch = await trio.to_thread.run_sync(self.load_batch, step + 1)
                ahead = trio.Event()
                nursery.start_soon(self._feed_ahead, step + 1, next_batch, ahead, nursery)
                fed = step + 1
            loss, busy, times = 0.0, {}, {}
            for device in self.plan.used_devices():
                report = await self.get(channels.ready(step, device))
                loss += report["loss"]
                busy[device] = report["busy_s"]
                times[device] = report.get("times", {})
            if not np.isfinite(loss):
                raise SwarmError(f"the loss became {loss} at step {step + 1}; try a smaller --lr or a longer --warmup")
            stop_here = step + 1 < total_steps and self.should_stop()
            is_last = step + 1 == total_steps or stop_here
            checkpoint = is_last or bool(self.checkpoint_every and (step + 1) % self.checkpoint_every == 0)
            if self.better is not None and not self.better.pays(total_steps - (step + 1)):
                self.decline_better(total_steps - (step + 1))  # and take no backup early for it
            backup = not is_last and self.backups.due(step + 1, bool(self.joined) or self.better is not None)
            await self._may_commit()
            for device in self.plan.used_devices():
                await self.ep.send(device, channels.decide(step), {"commit": True, "last": is_last,
                                                              "checkpoint": checkpoint, "backup": backup})
            self.committed = step + 1
            if self.committed > self.furthest:
                self.furthest, self.recoveries_in_a_row = self.committed, 0
            if backup:
                self.backups.begin(self.committed, self.plan.used_devices())
            for r in self.recoveries:
                if r.resumed_at is None:
                    r.resumed_at = trio.current_time()
            await self.backups.take_acks(self.ep, self.plan, self.replicate)
            since = time.monotonic()
            if on_step is not None:
                on_step(StepReport(self.committed, loss, since - t0, busy, times, self.epoch,
                                   self.committed <= self.replay_until, backup))
            if self.committed < self.replay_until:
                await self._reached("replay")  # a replayed step committed, and more are to be replayed
            self.epoch_steps += 1
            if self.epoch_steps == RECOST_AFTER and not is_last and self.recost is not None \
                    and self.epoch not in self.recost_epochs and self.committed > self.replay_until:
                await self.consider_recost(busy, times)
            if checkpoint:
                await self.collect()
            if stop_here:
                self.stopped_early = True
                break
            step += 1
            if fed != step and step < total_steps:
                next_batch = await trio.to_thread.run_sync(self.load_batch, step)
            if backup:  # the plan may change here: the samples sent ahead are out first
                await self._fed_ahead(ahead)
            if backup and await self.around_squeezed():
                fed = -1  # a new plan: the samples sent ahead went to the last one's devices
            elif self.joined and backup and await self.take_in_joined():
                fed = -1
            elif self.better is not None and backup and await self.switch_to_better(total_steps - self.committed):
                fed = -1
        if step >= total_steps or self.stopped_early:
            for device in self.plan.used_devices():
                await self.ep.send(device, channels.stop(), {})

    async def collect(self) -> None:
        """Fetch every stage's weights and optimizer state (sent by the first device of each
        stage after a checkpoint decision) into the coordinator's model."""
        states: dict[str, torch.Tensor] = {}
        for p in range(len(self.plan.stages)):
            device = stage_parts(self.plan, p)[0].device
            msg = await self.get(channels.state(self.committed, p, device))
            states.update(msg["states"])

        def load() -> None:  # in a thread: a big model takes a while, and heartbeats must go on
            load_states(self.trainer, states)
            if self.committed > 0:  # as the local optimizer has it after its last step
                set_lr(self.trainer.optimizer, self.trainer.cfg.lr_at(self.committed - 1))
        await trio.to_thread.run_sync(load)
        self.trainer.step_count = self.own_step = self.committed
        if self.save_hook is not None:
            await trio.to_thread.run_sync(self.save_hook)

    # ---- failures ----------------------------------------------------------------------
    async def recover(self, lost: set[str]) -> None:
        """Roll back to the newest complete backup, re-plan without `lost`, start a new epoch.
        A device the recovery counts on that is lost meanwhile cancels it (the loss watch, in
        each of its phases), and the next one starts from what this one left: without its
        losses (`recovering`) and the new ones, from the newest backup they all have."""
        detected = trio.current_time()
        if self.recoveries_in_a_row >= self.max_recoveries:
            raise self.give_up(f"lost {', '.join(sorted(lost))} after {self.recoveries_in_a_row} recoveries that "
                               f"never got past step {self.furthest}")
        self.recoveries_in_a_row += 1
        used = set(self.plan.used_devices())
        # roll-back: which devices are left, and so the newest backup they all have
        self.recovering, self.watched = set(lost), used - lost
        alive = set(self.control.alive())
        if not (used & alive) - lost - {self.own_device}:
            alive = await self.heard_again(used - alive - lost)
        dead = (used - alive) | lost
        self.recovering, self.watched = dead, used - dead
        self.joined |= lost & alive  # lost for a broken link, it still answers: taken in again at a backup step
        survivors = [d for d in self.plan.used_devices() if d not in dead]
        if self.replicate is not None and not set(survivors) - {self.own_device}:
            # other devices of the run that answer, outside the plan: re-planned over (a run cut
            # off from a majority stops on its lease, swarm/agent/quorum.py)
            survivors += self.control.admit(sorted(alive - dead - set(survivors) - {self.own_device}),
                                            len(survivors))
        if self.replicate is not None and not set(survivors) - {self.own_device}:
            raise SwarmError(f"cut off from every other device of the plan ({', '.join(sorted(dead))}) after step "
                             f"{self.committed}: those that are alive elect another coordinator from this run's "
                             f"replica, which carries the run on; this one gives up")
        if not survivors:
            raise self.give_up(f"lost every device of the plan ({', '.join(sorted(dead))})")
        self.backups.lose(dead)
        await self._reached("roll-back")
        # re-plan, in a thread (a heavy one takes a while, and heartbeats go on meanwhile)
        try:
            change = await trio.to_thread.run_sync(self._replan, dead, survivors)
        except PlanError as exc:
            raise self.give_up(f"lost {', '.join(sorted(dead))} and cannot re-plan over {', '.join(survivors)}: "
                               f"{exc}") from None
        await trio.lowlevel.checkpoint()  # a device lost while it ran: that plan is stale, and this is cancelled
        layer_count = len(self.trainer.desc.layers)
        if self.recovery == "heavy":
            moves, start = from_coordinator(change.plan, self.own_step, layer_count), self.own_step
        else:
            moves, start = self.backups.sources(change.plan, self.own_step, layer_count)
        what = f"lost {', '.join(sorted(dead))} during step {self.committed + 1}" if dead else \
            "taking the run over with every device of its plan"
        self.log(f"{what}: {change.how} re-plan ({change.why}); rolling back to step {start} and replaying")
        self.replay_until = max(self.replay_until, self.committed)
        self.committed = start
        self.epoch += 1
        self.recoveries.append(Recovery(self.epoch, sorted(dead), change.how, change.why, start, detected,
                                        plan=change.plan))
        # migration: the new epoch's devices go back to `start`, taking the layers they lack
        await self.start_epoch(change.plan, start, moves)
        await self._reached("migration")

    def _replan(self, dead: set[str], survivors: list[str]):
        """planner.replan over the survivors (in a thread: no trio here but the test hook)."""
        if self.phase_hook is not None:
            trio.from_thread.run(self.phase_hook, "re-plan")
        return replan(self.plan, self.trainer.desc, dead, survivors, self.strategy, prefer=self.recovery)

    async def heard_again(self, presumed: set[str]) -> set[str]:
        """The devices alive once one of `presumed` (not alive, but not the loss recovered
        from) answers again, or once PRESUMED_GRACE_S is over: giving a run up cannot be
        undone, a few seconds' wait can."""
        if presumed:
            with trio.move_on_after(PRESUMED_GRACE_S):
                while not presumed & set(self.control.alive()):
                    await trio.sleep(0.1)
                self.log(f"{', '.join(sorted(presumed & set(self.control.alive())))} answered again")
        return set(self.control.alive())

    async def consider_recost(self, busy: dict[str, float], times: dict[str, dict]) -> None:
        """Set each device's own compute in the step just committed (as its profile counts it,
        DeviceWorker.own_s; its busy time less what it waited inside it for its group's
        BatchNorm sums when it does not say) against the cost model, and keep a plan the
        corrected devices would run faster (planner/recost.py) for the next backup step."""
        own = {d: times.get(d, {}).get("own_s", max(0.0, busy[d] - times.get(d, {}).get("exchange_s", 0.0)))
               for d in busy}
        alive = self.control.alive()
        try:
            result = await trio.to_thread.run_sync(self.recost, self.plan, own, alive)
        except Exception as exc:  # noqa: BLE001 (an optimisation: whatever goes wrong, training goes on as planned)
            self.log(f"could not re-cost the plan from step {self.committed}: {exc}")
            return
        if result is None:
            return
        self.log(f"step {self.committed}: {result.describe()}")
        if result.plan is not None and set(result.plan.used_devices()) <= set(alive):
            self.better = result

    def decline_better(self, steps_left: int) -> None:
        """Let the re-costed plan go: what it saves over the `steps_left` steps after the next
        backup step would not pay for the switch (planner.recost.Recost.pays)."""
        better, self.better = self.better, None
        saved = better.current_s - (better.new_s if better.new_s is not None else better.current_s)
        self.log(f"the re-costed plan is not taken: {saved:.1f} s a step over the {steps_left} step(s) left "
                 f"would not pay for the switch")

    async def switch_to_better(self, steps_left: int) -> bool:
        """At a backup step, once it is complete, move to the re-costed plan where it pays for
        itself over the `steps_left` steps after it (planner.recost.Recost.pays); whether it did."""
        better = self.better
        if not better.pays(steps_left):
            self.decline_better(steps_left)
            return False
        self.better = None
        if not await self._backup_complete():
            return False
        plan = better.plan
        return await self._change_plan(
            plan, [], "recost", "re-costed on measured speeds", "the re-costed plan is not taken",
            f"re-planned from step {self.committed} on the measured speeds: {len(plan.used_devices())} devices, "
            f"{better.new_s:.1f} s a step predicted against {better.current_s:.1f} s", recost=True)

    async def _change_plan(self, plan: Plan, lost: list[str], how: str, why: str, refused: str, said: str,
                           recost: bool = False) -> bool:
        """Move to `plan` at the backup step just committed (complete), each device taking the
        layers it lacks from the backups of the plan's own devices (a device left out has no
        part in the next epoch: it sends none); whether it did. `refused` starts the line said
        when they lack a layer, `said` is the line said when it moves."""
        try:
            moves = layer_sources(self.backups.in_plan(plan), plan, self.committed)
        except PlanError as exc:
            self.log(f"{refused}: {exc}")
            return False
        self.log(said)
        self.epoch += 1
        if recost:
            self.recost_epochs.add(self.epoch)
        self.recoveries.append(Recovery(self.epoch, lost, how, why, self.committed, trio.current_time(), plan=plan))
        await self.start_epoch(plan, self.committed, moves)
        return True

    async def _backup_complete(self) -> bool:
        """Wait (up to the job's timeout) for the backup of the step just committed; whether
        every device confirmed it."""
        with trio.move_on_after(self.job.timeout_s):
            while self.committed in self.backups.pending:
                await trio.sleep(0.05)
                await self.backups.take_acks(self.ep, self.plan, self.replicate)
        return self.backups.step == self.committed

    async def around_squeezed(self) -> bool:
        """At a backup step: a device of the plan that can spare less now than the plan needs of
        it at a step's peak (another program there took memory: swarm/host/resources.py) is
        planned around once the backup is complete, before the kernel kills it for memory;
        whether the plan changed. A device that says nothing of its memory keeps its part."""
        used = self.plan.used_devices()
        room = room_left(self.plan, self.trainer.desc, self.trainer.cfg.optimizer)
        if not room:
            return False
        spare = await self.control.spare([d for d in used if d in room])
        short = {d: (spare[d], room[d][0]) for d in sorted(spare) if spare[d] < room[d][0]}
        if not short or not await self._backup_complete():
            return False
        keep = [d for d in self.control.alive() if d in used and d not in short]
        said = "; ".join(f"{d} can spare {spare / 2**20:.0f} MiB, under the {need / 2**20:.0f} MiB its part needs"
                         for d, (spare, need) in short.items())
        try:
            if not keep:
                raise PlanError("no other device of the plan is left")
            change = replan(self.plan, self.trainer.desc, set(short), keep, self.strategy)
        except PlanError as exc:
            self.log(f"{said}, and no plan goes around it ({exc}); going on as planned")
            return False
        return await self._change_plan(change.plan, sorted(short), "memory", said,
                                       f"{said}, and the plan around it cannot gather its layers; going on as planned",
                                       f"{said}: re-planned around it from step {self.committed} ({change.how})")

    async def take_in_joined(self) -> bool:
        """At a backup step, once it is complete, re-plan with devices that joined or came back;
        whether it did."""
        if not await self._backup_complete():
            return False
        alive = self.control.alive()
        joined = sorted(d for d in self.joined if d in alive and d not in self.plan.used_devices())
        self.joined.clear()
        joined = self.control.admit(joined, len(self.plan.used_devices()))
        if not joined:
            return False
        devices = [d for d in alive if d in self.plan.used_devices() or d in joined]
        try:
            change = replan(self.plan, self.trainer.desc, set(), devices, self.strategy, prefer="heavy")
        except PlanError as exc:
            self.log(f"{', '.join(joined)} joined, but no plan takes them in: {exc}")
            return False
        return await self._change_plan(
            change.plan, [], "rejoin", f"{', '.join(joined)} joined",
            f"{', '.join(joined)} joined, but the plan that takes them in cannot gather its layers",
            f"{', '.join(joined)} joined: re-planned over {len(devices)} devices from step {self.committed}")
