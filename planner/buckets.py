"""A stage's gradient buckets: the layers whose gradients a group sums together, and the
order its lanes sum them in (planner.plan's Stage.sum_order). The cost model
(planner.stage_work, planner.simulator) and the workers (swarm.execution.reduce) share them."""
from __future__ import annotations

BUCKET_BYTES = 1 << 20


def buckets_of(sizes: dict[int, int], least: int = BUCKET_BYTES) -> list[list[int]]:
    """The layers whose gradients a group sums together, by their parameter bytes (layers
    without parameters left out): from the last layer down, in the order the backward
    finishes them, each bucket closes once it holds `least` bytes. Every ring message costs
    the devices' CPU whatever its size, and most layers of a CNN are small."""
    buckets, current, held = [], [], 0
    for layer in sorted(sizes, reverse=True):
        current.append(layer)
        held += sizes[layer]
        if held >= least:
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


def sum_sequence(tops: list[int], sum_order: list[int] | None) -> list[int]:
    """The order a group's lanes sum buckets named by `tops` (their top layers), as a plan's
    Stage.sum_order asks: top layer first where it asks none. The plan names the buckets of
    float32 weights; a run of another precision may cut finer (buckets_of closes a bucket at
    its bytes), so each bucket takes the turn of the plan's bucket that holds its top layer,
    which is the plan's own order wherever the buckets are the plan's."""
    if not sum_order:
        return sorted(tops, reverse=True)
    named = sorted(sum_order)

    def turn(top: int) -> tuple[int, int]:
        holder = next((n for n in named if n >= top), named[-1])
        return sum_order.index(holder), -top
    return sorted(tops, key=turn)
