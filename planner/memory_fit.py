"""Whether a plan's stages fit in its devices' memory, checked before any device runs out of it.

A plan written by hand or built by a simple strategy (`--strategy pp` splits by FLOPs
alone) can put more on a device than it holds: its agent is then killed by the kernel in
the first step, and the run's recovery hands the same layers to the next device, which
goes the same way. So before a job starts, each device's peak is predicted with the
planner's memory model (planner.simulator) and held against the memory the device
advertised, less what its runtime holds.

The model is not exact, so the check uses it at its most lenient: saved tensors as the
model counts them (no allocator slack), the weights kept for rolling back, and
RUNTIME_FLOOR. That is below what a device really needs, so a plan over it cannot run and
is refused; a plan under it may still come close to the limit.
"""
from __future__ import annotations

from dataclasses import replace

from planner.memory import MemoryModel
from planner.model_desc import ModelDesc
from planner.plan import Plan
from planner.simulator import Overflow, kept_states, simulate
from planner.synthetic import flops_cluster
from planner.units import format_bytes

# What an agent holds before any stage: the interpreter and torch (an idle agent with a
# job's model loaded measures 340-370 MiB on x86-64 Linux); the least a device spends on it.
RUNTIME_FLOOR = 300 * 2**20


def memory_overflows(plan: Plan, desc: ModelDesc, memory: dict[str, float], optimizer: str = "sgd"
                     ) -> list[Overflow]:
    """The devices whose least possible peak exceeds `memory` (device -> bytes it has;
    devices missing from it are not checked). Each Overflow's `have` is what is left after
    the runtime.

    Besides what the planners' model counts for a stage (weights, gradients, optimizer
    state, activations), a device keeps for the whole run a snapshot of its stages' weights
    and optimizer state to roll back to, and the backup of each stage it holds for another
    device (swarm.execution.worker): those are added here."""
    known = {d: m for d, m in memory.items() if m and d in plan.used_devices()}
    if not known:
        return []
    runtime = RUNTIME_FLOOR
    budgets = {d: max(0, int(known[d] - runtime)) if d in known else 2**60 for d in plan.used_devices()}
    needs = _least_needs(plan, desc, optimizer, budgets)
    out = [Overflow(d, needs[d], budgets[d], plan.stages_of_device(d)) for d in known if needs[d] > budgets[d]]
    return sorted(out, key=lambda o: o.have - o.need)


def _least_needs(plan: Plan, desc: ModelDesc, optimizer: str, budgets: dict[str, float]) -> dict[str, float]:
    """Each device's least possible peak beside the runtime (memory_overflows)."""
    model = MemoryModel.estimated(desc, optimizer)
    # speeds do not change what a device keeps, only when: any will do; unknown memory: no limit
    cluster = flops_cluster(desc, {d: (1.0, budget) for d, budget in budgets.items()})
    # (the papers' model already lets the backward's buffers reuse freed room, as mapping does)
    timeline = simulate(replace(plan, mapped=False), desc, model, cluster, validate=False)
    kept = kept_states(plan, model)
    return {d: timeline.peak_memory.get(d, 0.0) + kept.get(d, 0.0) for d in plan.used_devices()}


def room_left(plan: Plan, desc: ModelDesc, optimizer: str = "sgd") -> dict[str, tuple[float, float, bool]]:
    """{device: (need, have, predicted)} for each device of `plan` whose memory its facts give
    (plan.devices[d]["memory"]: what the device could spare when the plan was made): the most
    it is predicted to hold at a step's peak, the runtime included. Where the planner
    simulated the plan (plan.predicted["memory_left"]), its prediction: `have` less what its
    budget leaves; otherwise (a plan written by hand or by a simple strategy) the least it can
    need, as memory_overflows counts it, and `predicted` is False. A device whose layers run
    on an accelerator is left out (its plan counts the accelerator's memory)."""
    facts = {d: plan.devices.get(d) or {} for d in plan.used_devices()}
    have = {d: float(f.get("memory") or 0) for d, f in facts.items() if not f.get("accelerator")}
    have = {d: m for d, m in have.items() if m}
    left = (plan.predicted or {}).get("memory_left") or {}
    if have and all(d in left for d in have):
        return {d: (m - left[d], m, True) for d, m in have.items()}
    needs = _least_needs(plan, desc, optimizer, {d: 2**60 for d in plan.used_devices()}) if have else {}
    return {d: (needs[d] + RUNTIME_FLOOR, m, False) for d, m in have.items()}


def describe_room(room: dict[str, tuple[float, float, bool]]) -> str | None:
    """room_left as `swarm train` prints it under its plan: "memory at a step's peak, of what
    each device can spare: dev0 700 MiB of 880 MiB, dev1 ..." (None for no device)."""
    if not room:
        return None
    least = not all(predicted for _, _, predicted in room.values())
    parts = [f"{d} {format_bytes(need)} of {format_bytes(have)}" + (" (SHORT)" if need > have else "")
             for d, (need, have, _) in room.items()]
    return (f"memory at a step's peak{' (at least)' if least else ''}, of what each device can spare: "
            + ", ".join(parts))


def describe(overflows: list[Overflow], runtime: float = RUNTIME_FLOOR) -> str:
    """One clause per distinct shortfall, naming its devices: "stage 0 needs at least 864 MiB
    on dev0, which has 1 GiB, about 300 MiB of it for the runtime"."""
    groups: dict[tuple, list[str]] = {}
    for o in overflows:
        groups.setdefault((tuple(o.stages), round(o.need), round(o.have)), []).append(o.device)
    clauses = []
    for (stages, need, have), devices in groups.items():
        which = f"stage {stages[0]}" if len(stages) == 1 else "stages " + ", ".join(str(s) for s in stages)
        where = devices[0] if len(devices) == 1 else "each of " + ", ".join(devices)
        clauses.append(f"{which} need{'s' if len(stages) == 1 else ''} at least {format_bytes(need)} on {where}, "
                       f"which {'has' if len(devices) == 1 else 'have'} {format_bytes(have + runtime)}, about "
                       f"{format_bytes(runtime)} of it for the runtime")
    return "; ".join(clauses)


__all__ = ["RUNTIME_FLOOR", "describe", "describe_room", "memory_overflows", "room_left"]
