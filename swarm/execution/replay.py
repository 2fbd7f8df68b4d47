"""What a device keeps of a training job across plan changes: its layers' committed state,
snapshots at backup steps, and backups it holds for other devices.

Layer states are flat dicts keyed like the model's state_dict ("layers.12.conv.weight",
"layers.12.bn.running_mean") plus optimizer slots ("layers.12.conv.weight|momentum_buffer"),
so any set of layers can be cut out, sent, merged and loaded into any stage that covers
them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
