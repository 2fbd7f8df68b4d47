"""Replay: how a training run survives a lost device and ends with the answer it would have
given without the loss. This module is the place to start; it holds the mechanics, both
sides, and names where the rest is.

1. Backups. At backup steps (every `backup_interval` committed steps, or by time: see
   BACKUP_SHARE) every device snapshots its own layers, and the layers of each stage run by
   one device alone are copied to a device of another stage (planner/backups.py says which).
   A backup counts once every device has confirmed it (BackupLedger on the coordinator,
   DeviceBackups on each device); the older one is then forgotten.
2. Roll-back. When a device is lost, every survivor goes back to the newest complete backup
   (DeviceStore keeps it) or, failing that, to the coordinator's own copy (the start, or the
   last checkpoint); the steps after it are run again. Data order, dropout masks and every
   sum are functions of the step alone, so the replayed steps give the same bits.
3. Re-plan. planner/replan.py shifts the plan over the survivors (lightweight) or plans again
   (heavy); coordinator.TrainingCoordinator.recover drives it and starts the new epoch.
4. Migration. planner/backups.layer_sources turns "who has which layers at that step" into
   moves; at the new epoch's start each device sends what others take from it and gathers
   its stages' states (DeviceBackups.send_moves and states_for). Devices that join or come
   back are taken in the same way at a complete backup step.
5. A loss during a recovery. The coordinator's loss watch runs through every phase (roll-back,
   re-plan, migration, replay: coordinator.RECOVERY_PHASES), so a device lost in one cancels
   the recovery there and starts the next over the survivors, from the newest backup they all
   still have (or the coordinator's own copy). Whatever waited on the device ends with it: the
   coordinator's waits with the cancelled phase, the workers' with their epoch, which the next
   epoch cancels. tests/test_recovery_faults.py loses a device in each phase.

Layer states are flat dicts keyed like the model's state_dict ("layers.12.conv.weight",
"layers.12.bn.running_mean") plus optimizer slots ("layers.12.conv.weight|momentum_buffer"),
so any set of layers can be cut out, sent, merged and loaded into any stage that covers
them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import trio

from planner.backups import Move, holdings, layer_sources
from planner.plan import Plan, PlanError
from swarm.execution import channels
from swarm.execution.channels import COORDINATOR
from swarm.host import malloc

# With backups by time (JobSpec.backup_interval 0), the share of the time backups may keep the
# links busy: after a backup that took t seconds to complete, the next one starts at the first
# step that ends t * (1 / BACKUP_SHARE - 1) seconds later or more. A lost device then costs at
# most about t / BACKUP_SHARE seconds of steps to replay.
BACKUP_SHARE = 0.1

LayerStates = dict[str, torch.Tensor]


def layer_of(key: str) -> int:
    """"layers.12.conv.weight|momentum_buffer" -> 12."""
    return int(key.split("|", 1)[0].split(".")[1])


def select(states: LayerStates, layers) -> LayerStates:
    """The entries of `states` for the given layer indices (a range or a set)."""
    wanted = set(layers)
    return {k: v for k, v in states.items() if layer_of(k) in wanted}


def layers_in(states: LayerStates) -> set[int]:
    return {layer_of(k) for k in states}


class MissingHolding(ValueError):
    """A device lacks the state of layers the recovery counted it as holding (it started again
    since, or dropped them): the run counts that holding as lost, and recovers again."""

    def __init__(self, holder: str, stage: int, step: int, layers: list[int]):
        self.holder = holder
        super().__init__(f"{holder} lacks layers {layers[:4]}{'...' if len(layers) > 4 else ''} of stage {stage} "
                         f"at step {step}, which it was counted as holding")


# the message above, wherever it travels as text (a failed job's detail)
MISSING_HOLDING = re.compile(r"([\w.-]+) lacks layers \[[\d, ]*\](?:\.\.\.)? of stage \d+ at step \d+, which it was counted "
                             r"as holding")


def holding_missed(exc: BaseException) -> MissingHolding | None:
    """The MissingHolding `exc` is or holds (a task group wraps what its tasks raise)."""
    if isinstance(exc, MissingHolding):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = holding_missed(inner)
        if found is not None:
            return found
    return None


def missing_holding(moves, device: str, stage: int, missing: set[int]) -> MissingHolding | None:
    """Which holder failed `device`: the first move that was to bring it any of `missing`
    layers of `stage` (None if none was: nobody was counted for them)."""
    for move in moves:
        lacking = missing & set(move.layers)
        if move.dst == device and move.stage == stage and lacking:
            return MissingHolding(move.src, stage, move.step, sorted(lacking))
    return None


PIECE_BYTES = 1 << 20


def cut_states(states: LayerStates, limit: int = PIECE_BYTES) -> list[list]:
    """States cut into pieces of about `limit` bytes (a big tensor spans several), to travel
    as separate messages: [[key, shape, offset, flat slice], ...] per piece; at least one.
    The slices are views of the states' own memory (no copies): the states must not change
    while the pieces are in use."""
    pieces, piece, room = [], [], limit
    for key, value in states.items():
        flat, offset = value.detach().reshape(-1), 0
        per = max(1, limit // max(1, value.element_size()))
        while True:
            take = min(flat.numel() - offset, max(1, room // value.element_size()), per)
            piece.append([key, list(value.shape), offset, flat[offset:offset + take]])
            offset += take
            room -= take * value.element_size()
            if room <= 0:
                pieces.append(piece)
                piece, room = [], limit
            if offset >= flat.numel():
                break
    return pieces + [piece] if piece or not pieces else pieces


class Assembly:
    """States put back together from the pieces `cut_states` cut, as they come (in any order):
    each piece is copied into its place and can be let go at once, so that no more than the
    states and one piece are held."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, list[int]] = {}

    def add(self, piece: list) -> None:
        for key, shape, offset, chunk in piece:
            flat = self._flat.get(key)
            if flat is None:
                self._shapes[key] = [int(n) for n in shape]
                flat = self._flat[key] = torch.empty(math.prod(self._shapes[key]), dtype=chunk.dtype)
            at = int(offset)
            flat[at:at + chunk.numel()].copy_(chunk.reshape(-1))

    def states(self) -> LayerStates:
        return {key: flat.reshape(self._shapes[key]) for key, flat in self._flat.items()}


def join_states(pieces: list[list]) -> LayerStates:
    """The states `cut_states` cut, from all its pieces (in any order)."""
    assembly = Assembly()
    for piece in pieces:
        assembly.add(piece)
    return assembly.states()


@dataclass
class Snapshot:
    step: int  # committed steps when it was taken
    states: LayerStates


@dataclass
class DeviceStore:
    """Per job, per device. `snapshots` are this device's own layers at backup steps (the
    newest two: the older stays until the newer backup is complete everywhere);
    `held` are other devices' layers it keeps as their backup, by step."""

    snapshots: list[Snapshot] = field(default_factory=list)
    held: dict[int, LayerStates] = field(default_factory=dict)
    kept_bytes: int = 0  # what it kept once its last backup was complete everywhere

    def snapshot(self, step: int, states: LayerStates) -> None:
        """Keep `states` as our layers at `step` (added to what we kept at that step). The
        tensors are kept as they are: they must be the caller's own copies, never changed."""
        for snap in self.snapshots:
            if snap.step == step:
                snap.states.update(states)
                return
        self.snapshots = sorted(self.snapshots, key=lambda s: s.step)[-1:] + [Snapshot(step, dict(states))]

    def hold(self, step: int, states: LayerStates) -> None:
        """Keep another device's `states` at `step` (kept as they are, as in snapshot())."""
        self.held.setdefault(step, {}).update(states)
        for old in sorted(self.held)[:-2]:  # the newest two backup steps are enough
            del self.held[old]

    def drop_after(self, step: int) -> None:
        """Drop what is newer than `step` (the run went back to `step`)."""
        self.snapshots = [s for s in self.snapshots if s.step <= step]
        for new in [s for s in self.held if s > step]:
            del self.held[new]

    def forget_before(self, step: int) -> None:
        """Drop what is older than `step` (a newer backup is complete everywhere)."""
        self.snapshots = [s for s in self.snapshots if s.step >= step]
        for old in [s for s in self.held if s < step]:
            del self.held[old]

    def keep_only(self, step: int, layers) -> None:
        """At `step`, keep only `layers` (what the plan now has us keep): after a re-plan, the
        layers we kept for the old one go once the new one's backup at that step is complete."""
        for snap in self.snapshots:
            if snap.step == step:
                snap.states = select(snap.states, layers)
        if step in self.held:
            self.held[step] = select(self.held[step], layers)

    def states_at(self, step: int, layers) -> LayerStates:
        """This device's knowledge of `layers` at `step`: its own snapshot and what it holds."""
        found: LayerStates = {}
        for snap in self.snapshots:
            if snap.step == step:
                found.update(select(snap.states, layers))
        found.update(select(self.held.get(step, {}), layers))
        return found

    def nbytes(self) -> int:
        """Bytes of tensors kept: snapshots and held backups."""
        kept = [s.states for s in self.snapshots] + list(self.held.values())
        return sum(v.numel() * v.element_size() for states in kept for v in states.values())

    def layers_at(self, step: int) -> set[int]:
        have = set()
        for snap in self.snapshots:
            if snap.step == step:
                have |= layers_in(snap.states)
        return have | layers_in(self.held.get(step, {}))


# ---- a device's side ------------------------------------------------------------------
class DeviceBackups:
    """A device's side of replay for one epoch (its worker holds one): the moves at the
    epoch's start, and its part in every backup."""

    def __init__(self, ep, plan: Plan, store: DeviceStore, timeout_s: float):
        self.ep = ep
        self.plan = plan
        self.store = store
        self.timeout_s = timeout_s
        self.device = ep.name

    async def send_moves(self, moves: list[Move], start: int) -> None:
        """Forget what is newer than the start step, and send the layers other devices take
        from us."""
        self.store.drop_after(start)
        async with trio.open_nursery() as nursery:
            for move in moves:
                if move.src == self.device and move.dst != self.device:
                    nursery.start_soon(self._push, move)

    async def _push(self, move: Move) -> None:
        states = self.store.states_at(move.step, move.layers)
        await self.ep.send(move.dst, channels.layers(move.stage, self.device), {"states": states})

    async def states_for(self, p: int, moves: list[Move]) -> LayerStates:
        """Stage p's states at the start step: what we kept ourselves, and what others send."""
        states: LayerStates = {}
        for move in moves:
            if move.dst != self.device or move.stage != p:
                continue
            if move.src == self.device:
                states.update(self.store.states_at(move.step, move.layers))
            else:
                states.update((await self.ep.mailbox.get(channels.layers(p, move.src), self.timeout_s))["states"])
        return states

    def back_up(self, step: int, states: dict[int, LayerStates], nursery) -> None:
        """At a backup step: keep `states` (our stages', our own copies, never changed) as the
        snapshot, and in the background send our single-device stages to their holders (in
        pieces, so that the next step's messages to the same device pass between them) and
        take in what we hold for others, then tell the coordinator. The next step starts at
        once: a backup counts once its holders have it."""
        self.store.snapshot(step, {k: v for s in states.values() for k, v in s.items()})
        for p, holder in self.plan.backups.items():
            if self.plan.stages[p].devices == [self.device] and holder != self.device:
                nursery.start_soon(self._send_backup, holder, step, p, states[p])
        held = [p for p, holder in self.plan.backups.items() if holder == self.device
                and self.plan.stages[p].devices != [self.device]]
        nursery.start_soon(self._hold_backups, step, held)

    async def _send_backup(self, holder: str, step: int, p: int, states: LayerStates) -> None:
        pieces = cut_states(states)
        for i, piece in enumerate(pieces):
            await self.ep.send(holder, channels.backup(step, p, i), {"piece": piece, "pieces": len(pieces)})

    async def _hold_backups(self, step: int, stages: list[int]) -> None:
        for p in stages:
            assembly = Assembly()
            first = await self.ep.mailbox.get(channels.backup(step, p, 0), self.timeout_s)
            count = first["pieces"]
            assembly.add(first.pop("piece"))
            for i in range(1, count):
                assembly.add((await self.ep.mailbox.get(channels.backup(step, p, i), self.timeout_s))["piece"])
            self.store.hold(step, assembly.states())
        await self.ep.send(COORDINATOR, channels.backup_ready(step, self.device), {})
        await self.ep.mailbox.get(channels.forget(step), math.inf)
        self.store.forget_before(step)
        self.store.keep_only(step, holdings(self.plan).get(self.device, set()))
        kept, self.store.kept_bytes = self.store.kept_bytes, self.store.nbytes()
        if self.store.kept_bytes < kept:
            # it keeps less than after the backup before (a re-plan left it fewer layers): what
            # the next backups will not take up again goes back to the system. Not after a
            # backup of the same size: giving back the heap's free pages gives back the
            # activations' too (freed at the end of every step), and the next step would fault
            # in and clear them all again (for yolov2-16 at 416, one sample, 250 MB and about
            # 0.1 CPU-s)
            await trio.to_thread.run_sync(malloc.give_back)


# ---- the coordinator's side -----------------------------------------------------------
@dataclass
class Recovery:
    """One change of plan during a run: a loss (lightweight or heavy re-plan), a rejoin, or a
    plan re-costed on the devices' measured speeds."""
    epoch: int
    lost: list[str]
    how: str  # lightweight | heavy | rejoin | recost | memory (a device short of memory planned around)
    why: str
    rolled_back_to: int  # committed steps the run went back to
    detected_at: float  # trio clock when the loss was noticed
    resumed_at: float | None = None  # first committed step after it
    plan: Plan | None = None


class BackupLedger:
    """The coordinator's side of the backups: which backup steps are under way, the newest
    complete one and what each device holds there, and when the next one is due."""

    def __init__(self, interval: int):
        self.interval = interval  # back up every this many committed steps; 0: by time
        self.step: int | None = None  # the newest complete backup step
        self.holdings: dict[str, set[int]] = {}  # device -> layers it has at `step`
        self.pending: dict[int, set[str]] = {}  # step -> devices not ready yet
        self.started: dict[int, float] = {}  # step -> when its backup began
        self.next_at = -math.inf  # with backups by time: not before then

    def epoch_started(self, start: int, devices: list[str]) -> None:
        """Every epoch's devices snapshot at its start step; that backup is timed from the
        epoch's first step, not from here: building the stages and moving layers is no part
        of what a backup costs. An epoch that starts before the newest backup (its layers
        came from the coordinator's copy) has every device drop what is newer than its
        start (DeviceBackups.send_moves): that backup is gone, and a replica must not name it."""
        self.pending = {start: set(devices)}
        self.started = {}
        if self.step is not None and self.step > start:
            self.step, self.holdings = None, {}

    def step_begins(self, step: int) -> None:
        if step in self.pending:  # an epoch's first snapshot, timed from its first step
            self.started.setdefault(step, trio.current_time())

    def due(self, committed: int, waiting_to_join: bool) -> bool:
        """Back up after this commit? Every `interval` steps once the backup under way (if any) is
        complete, or (0) by time: when no backup is under way and the last one's quiet period is
        over, or a device waits to be taken in (which needs a backup step). One backup at a time:
        a device keeps its newest two snapshots, which must include the last complete one."""
        if self.interval:
            return committed % self.interval == 0 and not self.pending
        return not self.pending and (waiting_to_join or trio.current_time() >= self.next_at)

    def begin(self, committed: int, devices: list[str]) -> None:
        self.pending[committed] = set(devices)
        self.started[committed] = trio.current_time()

    async def take_acks(self, ep, plan: Plan, before_forget=None) -> None:
        """Note the backup steps every device has confirmed (without waiting for more), and
        tell the devices to forget what is older; `before_forget()` (async) is awaited first
        (the coordinator's replica names the new backup before the older one is gone)."""
        for step in sorted(self.pending):
            waiting = self.pending[step]
            for device in list(waiting):
                try:
                    ep.mailbox.get_nowait(channels.backup_ready(step, device))
                    waiting.discard(device)
                except KeyError:
                    pass
            if not waiting:
                del self.pending[step]
                took = trio.current_time() - self.started.pop(step, trio.current_time())
                self.next_at = trio.current_time() + took * (1 / BACKUP_SHARE - 1)
                if self.step is None or step >= self.step:
                    # also a second snapshot of the same step (an epoch's first, after a re-plan): the
                    # devices now keep only what the plan has them keep (DeviceBackups._hold_backups)
                    self.step = step
                    self.holdings = holdings(plan)
                if before_forget is not None:
                    await before_forget()
                for device in plan.used_devices():
                    await ep.send(device, channels.forget(step), {})

    def lose(self, dead: set[str]) -> None:
        self.holdings = {d: layers for d, layers in self.holdings.items() if d not in dead}

    def sources(self, plan: Plan, own_step: int, layer_count: int) -> tuple[list[Move], int]:
        """Moves for `plan` from the newest complete backup the survivors have, and its step;
        else from the coordinator's own copy (the start, or the last checkpoint, at
        `own_step`)."""
        if self.step is not None and self.step >= own_step:
            try:
                return layer_sources(self.in_plan(plan), plan, self.step), self.step
            except PlanError:
                pass
        return from_coordinator(plan, own_step, layer_count), own_step

    def in_plan(self, plan: Plan) -> dict[str, set[int]]:
        """The holdings of `plan`'s devices: a device left out of a plan has no part in its epoch,
        so it sends no layers (a move from it would never come)."""
        used = set(plan.used_devices())
        return {d: layers for d, layers in self.holdings.items() if d in used}


def from_coordinator(plan: Plan, own_step: int, layer_count: int) -> list[Move]:
    """Moves that give every device of `plan` its layers from the coordinator's own copy."""
    return layer_sources({COORDINATOR: set(range(layer_count))}, plan, own_step)
