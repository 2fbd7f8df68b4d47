"""Checkpointed segments: where a stage that checkpoints (Stage.checkpoint) cuts its layers.

A stage that checkpoints runs its layers in segments. The forward of a segment keeps nothing
for the backward but the maps it reads from before it; the backward runs the segment's
forward again, keeping everything this time, and back-propagates through it before the
segment in front of it is remade. So a micro-batch keeps, until its backward, only the maps
that cross a segment's start, and its backward holds one segment's saved maps at a time, for
one more forward of the stage (swarm.zoo.net.Net.checkpoint runs it; planner.memory and the
simulator count it).

The segments are the model's, fixed by its layers alone so that every stage and every
planner agrees on them. A micro-batch's backward holds the maps crossing every segment's
start plus one segment's saved maps, so the segments split the saved bytes evenly (a CNN's
first layers save the most), and their number is the one that makes that sum least (about
sqrt(layers) where the layers save alike, Chen et al. 2016). A stage's segments are the
model's that fall inside it, the first starting at the stage's first layer.
"""
from __future__ import annotations

from dataclasses import replace

from planner.cluster import Cluster
from planner.costs import CostTable
from planner.memory import MemoryModel, estimate_activation_bytes
from planner.model_desc import ModelDesc


def segment_starts(desc: ModelDesc) -> tuple[int, ...]:
    """The first layer of each of the model's segments, 0 first."""
    saved = estimate_activation_bytes(desc)
    total = sum(saved)
    best = None
    for count in range(1, len(desc.layers) + 1):
        starts, held = [0], 0.0
        for i, bytes_ in enumerate(saved):
            if i > starts[-1] and held + bytes_ / 2 > len(starts) * total / count:
                starts.append(i)
            held += bytes_
        bounds = starts + [len(saved)]
        peak = (sum(desc.boundary_bytes(b) for b in starts)
                + max(sum(saved[a:b]) for a, b in zip(bounds, bounds[1:])))
        if best is None or peak < best[0]:
            best = (peak, tuple(starts))
    return best[1]


def stage_segments(desc: ModelDesc, first: int, last: int) -> list[tuple[int, int]]:
    """The segments [a, b) a stage of layers [first, last) runs in."""
    cuts = [first] + [s for s in segment_starts(desc) if first < s < last] + [last]
    return list(zip(cuts, cuts[1:]))


def kept_bytes(desc: ModelDesc, first: int, last: int) -> int:
    """Bytes per sample a micro-batch of a checkpointing stage of layers [first, last) keeps
    until its backward: each segment's inputs from outside it (maps made before the segment
    that a layer of it reads; the stage's own inputs for its first), each map once however
    many segments read it."""
    segments = stage_segments(desc, first, last)
    segment_of = {i: k for k, (a, b) in enumerate(segments) for i in range(a, b)}
    kept = set()
    for j in range(first, last):
        for src in desc.layers[j].inputs:
            if segment_of.get(src) != segment_of[j]:
                kept.add(src)
    return sum(desc.input_bytes if src < 0 else desc.layers[src].out_bytes for src in kept)


def _checkpointed(costs: CostTable) -> CostTable:
    """The costs of stages that checkpoint: each layer's backward also runs its forward again."""
    return replace(costs, bwd=costs.bwd + costs.fwd, source=costs.source + " + checkpointing", _cum={})


def checkpointing(mem: MemoryModel, cluster: Cluster, desc: ModelDesc) -> tuple[MemoryModel, Cluster]:
    """The memory model (MemoryModel.checkpointing) and devices of plans whose stages run in
    checkpointed segments (idempotent). Like remaking (planner.recompute), it is the whole
    plan's: `auto` checkpoints all of a plan's stages or none."""
    if cluster.recomputing:
        raise ValueError("a plan remakes BatchNorm or checkpoints its segments, not both")
    if len(desc.layers) != cluster.devices[0].costs.num_layers:
        raise ValueError(f"the devices' costs cover {cluster.devices[0].costs.num_layers} layers, "
                         f"{desc.name} has {len(desc.layers)}")
    if cluster.checkpointing:
        return mem.checkpointing(), cluster
    devices = [replace(d, costs=_checkpointed(d.costs),
                       cpu_costs=_checkpointed(d.cpu_costs) if d.cpu_costs is not None else None)
               for d in cluster.devices]
    return mem.checkpointing(), replace(cluster, devices=devices, checkpointing=True)
