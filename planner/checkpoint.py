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

from dataclasses import dataclass, fields, replace

import numpy as np

from planner.cluster import Cluster
from planner.costs import CostTable
from planner.memory import MemoryModel, estimate_activation_bytes
from planner.model_desc import ModelDesc


def segment_starts(desc: ModelDesc) -> tuple[int, ...]:
    """The first layer of each of the model's segments, 0 first."""
    return desc.memo("segment_starts", lambda: _segment_starts(desc))


def _segment_starts(desc: ModelDesc) -> tuple[int, ...]:
    saved = estimate_activation_bytes(desc)
    total = sum(saved)
    held_before = [0.0]  # saved bytes of the layers before each index
    for bytes_ in saved:
        held_before.append(held_before[-1] + bytes_)
    best = None
    for count in range(1, len(desc.layers) + 1):
        starts = [0]
        for i, bytes_ in enumerate(saved):
            if i > starts[-1] and held_before[i] + bytes_ / 2 > len(starts) * total / count:
                starts.append(i)
        bounds = starts + [len(saved)]
        peak = (sum(desc.boundary_bytes(b) for b in starts)
                + max(held_before[b] - held_before[a] for a, b in zip(bounds, bounds[1:])))
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
    return sum(kept_by_segment(desc, first, last))


def kept_by_segment(desc: ModelDesc, first: int, last: int) -> list[int]:
    """kept_bytes by the first of the stage's segments that reads each map: the backward, last
    segment first, frees a kept map once that segment is back-propagated, so while segment k
    is remade the maps counted at 0..k are alive and the rest freed."""
    segments = stage_segments(desc, first, last)
    segment_of = {i: k for k, (a, b) in enumerate(segments) for i in range(a, b)}
    reader: dict[int, int] = {}  # each kept map: the first segment that reads it
    for j in range(first, last):
        for src in desc.layers[j].inputs:
            if segment_of.get(src) != segment_of[j]:
                reader[src] = min(reader.get(src, segment_of[j]), segment_of[j])
    by_segment = [0] * len(segments)
    for src, k in reader.items():
        by_segment[k] += desc.input_bytes if src < 0 else desc.layers[src].out_bytes
    return by_segment


@dataclass
class CheckpointingModel(MemoryModel):
    """MemoryModel for stages that run in checkpointed segments (planner.checkpoint): a
    micro-batch keeps, until its backward, only each segment's inputs from outside it
    (kept_bytes); its backward remakes one segment at a time, keeping everything of it, and
    back-propagates it. `act_bytes` and the tables built on them stay the plain model's (what a
    segment keeps while it is remade); activations, transient and buffers are per stage, as
    kept_bytes is not a sum over layers (a map read by two segments is kept once).

    With measured act_bytes (`measured`), the kept bytes stay the estimate's: they are whole
    maps crossing a segment's start, whose size the layers' shapes give exactly, where the
    measured/estimated ratio is about what autograd saves inside layers, which a checkpointed
    segment does not keep; the segment being remade is charged its measured bytes.

    While a segment is remade, the maps kept only for the segments behind it have been freed
    (kept_by_segment). Where the allocator reuses freed room (`reuse`: jemalloc, a mapped heap)
    they are not charged; on glibc's heap, which does not hand that room to maps of other sizes,
    they stay charged. The segment's own inputs are also among its saved bytes, charged twice.
    yolov2-16, 4 samples, one process above its start (bench/RESULTS.md, 2026-12-04 15:53-16:30
    UTC): at 320 jemalloc 365-366 MiB against 394 with the stage scratch (472 charging every
    kept map), glibc's heap 309-400 over eight layouts against 440, mapped 260-292 against 328;
    at 416 jemalloc 540-542 against 622, mapped 412-419 against 510. What reads
    act_bytes or transient_table directly (planner.asteroid_tables) sees the plain model's:
    Asteroid's search plans no such stage."""

    checkpointed = True

    def __post_init__(self):
        super().__post_init__()
        self._per_stage: dict[tuple[int, int], tuple[float, float, float]] = {}

    def _stage_bytes(self, first: int, last: int) -> tuple[float, float, float]:
        """Per sample, for a stage of layers [first, last): (kept, held, bound). kept: what a
        micro-batch keeps until its backward (kept_bytes). held: what its backward holds beyond
        that at its worst segment: the segment's plain saved bytes (remade, all alive when its
        backward begins) plus its backward's buffers beyond them (the plain transient of the
        segment's range), the most over the stage's segments. bound: the same with each
        segment's largest buffers and nothing freed (an upper bound of held, for buffers)."""
        key = (first, last)
        if key not in self._per_stage:
            segments = stage_segments(self.desc, first, last)
            saved = [float(self._cum_act[b] - self._cum_act[a]) for a, b in segments]
            kept = np.cumsum(kept_by_segment(self.desc, first, last), dtype=float)  # alive while k is remade
            freed = kept[-1] - kept if self.reuse else np.zeros(len(segments))
            held = max(float(self.transient_table[a, b]) + s - f for (a, b), s, f in zip(segments, saved, freed))
            bound = max(float(self.grad_bytes[a:b].max()) + s for (a, b), s in zip(segments, saved))
            self._per_stage[key] = (float(kept[-1]), held, bound)
        return self._per_stage[key]

    def activations(self, first: int, last: int, batch: float) -> float:
        """What one micro-batch of `batch` samples keeps until its backward: the maps crossing
        its segments' starts (kept_bytes)."""
        if last <= first:
            return 0.0
        return batch * (self.slack * self.share_factor(batch) * self._stage_bytes(first, last)[0])

    def transient(self, first: int, last: int, batch: float) -> float:
        """What one micro-batch's backward holds beyond what it kept, at its worst segment: the
        segment remade whole, and its backward's buffers beyond what it has freed."""
        if last <= first:
            return 0.0
        return batch * (self.slack * self.share_factor(batch) * self._stage_bytes(first, last)[1])

    def buffers(self, first: int, last: int, batch: float) -> float:
        """An upper bound of transient: a segment remade whole and its largest buffers, nothing freed."""
        if last <= first:
            return 0.0
        return batch * (self.slack * self.share_factor(batch) * self._stage_bytes(first, last)[2])


def checkpointing_model(mem: MemoryModel) -> MemoryModel:
    """`mem` for stages that run in the model's checkpointed segments (Stage.checkpoint):
    CheckpointingModel (idempotent; a model that remakes BatchNorm cannot also checkpoint)."""
    if mem.checkpointed:
        return mem
    if mem.remade:
        raise ValueError("a stage remakes BatchNorm or checkpoints its segments, not both")
    return CheckpointingModel(**{f.name: getattr(mem, f.name) for f in fields(mem)})


def _checkpointed(costs: CostTable) -> CostTable:
    """The costs of stages that checkpoint: each layer's backward also runs its forward again."""
    return replace(costs, bwd=costs.bwd + costs.fwd, source=costs.source + " + checkpointing")


def checkpointing(mem: MemoryModel, cluster: Cluster, desc: ModelDesc) -> tuple[MemoryModel, Cluster]:
    """The memory model (checkpointing_model) and devices of plans whose stages run in
    checkpointed segments (idempotent). Like remaking (planner.recompute), it is the whole
    plan's: `auto` checkpoints all of a plan's stages or none."""
    if cluster.recomputing:
        raise ValueError("a plan remakes BatchNorm or checkpoints its segments, not both")
    if len(desc.layers) != cluster.devices[0].costs.num_layers:
        raise ValueError(f"the devices' costs cover {cluster.devices[0].costs.num_layers} layers, "
                         f"{desc.name} has {len(desc.layers)}")
    if cluster.checkpointing:
        return checkpointing_model(mem), cluster
    devices = [replace(d, costs=_checkpointed(d.costs),
                       cpu_costs=_checkpointed(d.cpu_costs) if d.cpu_costs is not None else None)
               for d in cluster.devices]
    return checkpointing_model(mem), replace(cluster, devices=devices, checkpointing=True)
