"""Backups and migration of a plan's layers: who keeps a copy of which stage, what each
device has once a backup step is complete, and which layers move where when a new plan
starts from a committed step (pure)."""
from __future__ import annotations

from dataclasses import dataclass

from planner.plan import Plan, PlanError


@dataclass
class Move:
    """Send the state of `layers` at committed step `step` from `src` to `dst` (for its stage
    `stage` of the new plan). `src` may be "coordinator"."""

    src: str
    dst: str
    stage: int
    layers: list[int]
    step: int

    def to_dict(self) -> dict:
        return {"src": self.src, "dst": self.dst, "stage": self.stage, "layers": self.layers, "step": self.step}

    @classmethod
    def from_dict(cls, d: dict) -> "Move":
        return cls(d["src"], d["dst"], int(d["stage"]), [int(x) for x in d["layers"]], int(d["step"]))


def holdings(plan: Plan) -> dict[str, set[int]]:
    """Which layers each device has once a backup step of `plan` is complete: its stages'
    layers (its snapshot) and the stages it backs up."""
    have: dict[str, set[int]] = {}
    for p, s in enumerate(plan.stages):
        for d in s.devices:
            have.setdefault(d, set()).update(range(s.first, s.last))
        holder = plan.backups.get(p)
        if holder is not None:
            have.setdefault(holder, set()).update(range(s.first, s.last))
    return have


def backup_holders(plan: Plan) -> dict[int, str]:
    """Topology-driven backups: a stage on one device is copied to a device of the next stage
    (the last to the first stage); a stage on several devices needs none, its survivors
    have its weights."""
    holders = {}
    n = len(plan.stages)
    for p, s in enumerate(plan.stages):
        if len(s.devices) > 1:
            continue
        owner = s.devices[0]
        for q in [(p + k) % n for k in range(1, n + 1)]:
            candidates = [d for d in plan.stages[q].devices if d != owner]
            if candidates:
                holders[p] = candidates[0]
                break
    return holders


def layer_sources(holdings: dict[str, set[int]], plan: Plan, step: int, preferred: dict[int, str] | None = None
                  ) -> list[Move]:
    """Moves that give every device of `plan` the layers of its stages at `step`, from the
    devices in `holdings` (device -> layers it has at that step). A device takes what it has
    itself; otherwise the layer comes from `preferred[layer]` if it has it, else the first
    holder by name. PlanError names a layer nobody has."""
    moves: dict[tuple[str, str, int], list[int]] = {}
    for p, s in enumerate(plan.stages):
        for dst in s.devices:
            for layer in range(s.first, s.last):
                if layer in holdings.get(dst, set()):
                    src = dst
                else:
                    pick = (preferred or {}).get(layer)
                    have = sorted(d for d, ls in holdings.items() if layer in ls)
                    if not have:
                        raise PlanError(f"no surviving device has layer {layer} at step {step}")
                    src = pick if pick in have else have[0]
                moves.setdefault((src, dst, p), []).append(layer)
    return [Move(src, dst, p, layers, step) for (src, dst, p), layers in moves.items()]
