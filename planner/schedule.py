"""The micro-batch schedule of a pipeline stage: one pure function, used by the workers,
the simulator and the pictures alike.

1F1B with K_p warm-up forwards (Asteroid, section 3.2): stage p first runs K_p forwards,
then alternates one backward and one forward until the forwards run out, then drains the
backwards. At most K_p micro-batches of activations are resident on the stage. With
P = 3 stages, M = 6 micro-batches and K_p = 2(P - p) - 1 = 5, 3, 1:

    stage 0:  F0 F1 F2 F3 F4 B0 F5 B1 B2 B3 B4 B5
    stage 1:  F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5
    stage 2:  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

K_p = M for every stage is GPipe's order (all forwards, then all backwards).
"""
from __future__ import annotations

from typing import Literal

Op = tuple[Literal["F", "B"], int]


def asteroid_warmup(num_stages: int, stage: int) -> int:
    """Asteroid's K_p = 2(P - p) - 1 warm-up forwards for 0-based stage p."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    return 2 * (num_stages - stage) - 1


def stage_schedule(microbatches: int, warmup: int) -> list[Op]:
    """The order of forward ("F", m) and backward ("B", m) work on one stage."""
    if microbatches < 1:
        raise ValueError("need at least one micro-batch")
    if warmup < 1:
        raise ValueError("a stage needs at least one warm-up forward")
    k = min(warmup, microbatches)
    ops: list[Op] = [("F", m) for m in range(k)]
    next_f, next_b = k, 0
    while next_f < microbatches:
        ops.append(("B", next_b))
        next_b += 1
        ops.append(("F", next_f))
        next_f += 1
    ops.extend(("B", m) for m in range(next_b, microbatches))
    return ops


def overlap_units(ops: list[Op]) -> list[list[Op]]:
    """The schedule of a stage that overlaps (Stage.overlap): each backward with the forward
    that follows it, run side by side; every other op alone. Forwards keep their order, and
    backwards theirs:

        F0 B0 F1 B1 F2 B2 F3 B3  ->  [F0] [B0 F1] [B1 F2] [B2 F3] [B3]

    Beside a backward one more micro-batch is resident than the schedule alone holds."""
    units: list[list[Op]] = []
    i = 0
    while i < len(ops):
        if ops[i][0] == "B" and i + 1 < len(ops) and ops[i + 1][0] == "F":
            units.append([ops[i], ops[i + 1]])
            i += 2
        else:
            units.append([ops[i]])
            i += 1
    return units


def check_warmups(warmups: list[int], microbatches: int) -> None:
    """Warm-ups must not grow along the pipeline, or a stage would wait for a forward its
    predecessor only sends after a backward that cannot come: a deadlock."""
    for p, k in enumerate(warmups):
        if k < 1:
            raise ValueError(f"stage {p}: warm-up {k} must be at least 1")
    effective = [min(k, microbatches) for k in warmups]
    for p in range(len(effective) - 1):
        if effective[p] < effective[p + 1]:
            raise ValueError(f"stage {p} warms up with {effective[p]} forwards but stage {p + 1} with "
                             f"{effective[p + 1]}: warm-ups must not grow along the pipeline")


def peak_resident(ops: list[Op]) -> int:
    """Most micro-batches whose activations are held at once (forwarded, not yet backed)."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def draw(schedules: list[list[Op]]) -> str:
    """One text line per stage, as in the module docstring."""
    return "\n".join(f"stage {p}:  " + " ".join(f"{k}{m}" for k, m in ops) for p, ops in enumerate(schedules))
