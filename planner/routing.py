"""Who holds which block of which map, and what must move between stages (pure).

A block is a rectangle of a micro-batch's map: a range of samples (positions inside the
micro-batch) and, for spatial maps, a range of rows and columns. Each stage says which
blocks its parts need at its input boundary and which they produce at its output
boundary; moving data between stages is the pairwise intersection of the two. Backward,
gradients travel the same intersections the other way, and a receiver adds up the
pieces it gets (tiles' extended regions overlap, so their input gradients do too).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.model_desc import ModelDesc
from planner.plan import Plan, Stage

Span = tuple[int, int]  # [lo, hi)


@dataclass(frozen=True)
class Block:
    samples: Span
    rows: Span | None = None  # None: the whole map (or a map without rows: vectors)
    cols: Span | None = None

    @property
    def count(self) -> int:
        return self.samples[1] - self.samples[0]


@dataclass(frozen=True)
class Part:
    """One worker's share of a stage: a dp replica, a tile, or the single device."""

    stage: int
    index: int  # replica index (dp), tile index (tiles: r * tiles per replica + tile of replica r), 0 (single)
    device: str


@dataclass(frozen=True)
class Holding:
    part: Part
    block: Block


@dataclass(frozen=True)
class Transfer:
    src: Part
    dst: Part
    block: Block  # in micro-batch coordinates


def _cut(a: Span | None, b: Span | None) -> Span | None | bool:
    """Intersection of two spans; None means "everything"; False means empty."""
    if a is None:
        return b
    if b is None:
        return a
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else False


def intersect(a: Block, b: Block) -> Block | None:
    samples = _cut(a.samples, b.samples)
    rows = _cut(a.rows, b.rows)
    cols = _cut(a.cols, b.cols)
    if samples is False or rows is False or cols is False:
        return None
    return Block(samples, rows, cols)


def replica_spans(stage: Stage, mb_size: int) -> list[Span]:
    """Samples of each dp member (in `stage.devices` order) for a micro-batch of `mb_size`
    (a replica of a replicated stage takes whole micro-batches, which a dp replica's group
    splits among its devices)."""
    if stage.mode != "dp":
        return [(0, mb_size)] * stage.replica_count()
    spans = []
    for r in range(stage.replica_count()):  # each replica's group splits its own micro-batches
        start = 0
        for device in stage.replica_devices(r):
            n = stage.allocation[device]
            spans.append((start, start + n))
            start += n
        if start != mb_size:
            raise ValueError(f"allocation covers {start} samples of a micro-batch of {mb_size}")
    return spans


def stage_parts(plan: Plan, p: int) -> list[Part]:
    stage = plan.stages[p]
    if stage.mode == "tiles":
        return [Part(p, k, d) for k, d in enumerate(stage.tile_devices)]
    return [Part(p, k, d) for k, d in enumerate(stage.devices)]


def parts_on(plan: Plan, device: str) -> list[Part]:
    return [part for p in range(len(plan.stages)) for part in stage_parts(plan, p) if part.device == device]


def runs(plan: Plan, part: Part, m: int) -> bool:
    """Whether `part` works on micro-batch m (in a replicated stage, only its replica's)."""
    return plan.stages[part.stage].replica_of_part(part.index) == plan.replica_of(m, part.stage)


class Layout:
    """Input needs and output holdings of every part of every stage, for one micro-batch size.

    `tile_regions(stage_index) -> (needed input, owned output, returned input gradient)`,
    each a (rows, cols) span pair per tile, supplies the geometry of tiles stages."""

    def __init__(self, plan: Plan, desc: ModelDesc, tile_regions=None):
        self.plan = plan
        self.desc = desc
        self.tile_regions = tile_regions

    def _tiles(self, p: int):
        if self.tile_regions is None:
            raise ValueError(f"stage {p} is a tiles stage but no tile geometry was given")
        return self.tile_regions(p)

    def inputs(self, p: int, mb_size: int) -> list[Holding]:
        """What each part of stage p needs of every live map at its input boundary."""
        stage = self.plan.stages[p]
        parts = stage_parts(self.plan, p)
        if stage.mode == "tiles":
            needed = self._tiles(p)[0]
            return [Holding(part, Block((0, mb_size), *needed[part.index % len(needed)])) for part in parts]
        return [Holding(part, Block(span)) for part, span in zip(parts, replica_spans(stage, mb_size))]

    def input_grads(self, p: int, mb_size: int) -> list[Holding]:
        """What each part of stage p returns of the gradient at its input boundary: a tile
        its owned pixels (tiles settle their overlaps among themselves), others their input."""
        stage = self.plan.stages[p]
        if stage.mode == "tiles":
            returned = self._tiles(p)[2]
            return [Holding(part, Block((0, mb_size), *returned[part.index % len(returned)])) for part in stage_parts(self.plan, p)]
        return self.inputs(p, mb_size)

    def outputs(self, p: int, mb_size: int) -> list[Holding]:
        """What each part of stage p holds of every live map at its output boundary."""
        stage = self.plan.stages[p]
        parts = stage_parts(self.plan, p)
        if stage.mode == "tiles":
            owned = self._tiles(p)[1]
            return [Holding(part, Block((0, mb_size), *owned[part.index % len(owned)])) for part in parts]
        return [Holding(part, Block(span)) for part, span in zip(parts, replica_spans(stage, mb_size))]

    def forward_transfers(self, p: int, mb_size: int) -> list[Transfer]:
        """Blocks moving from stage p's outputs to stage p + 1's inputs."""
        return transfers(self.outputs(p, mb_size), self.inputs(p + 1, mb_size))

    def backward_transfers(self, p: int, mb_size: int) -> list[Transfer]:
        """Gradient blocks moving from stage p + 1's inputs back to stage p's outputs."""
        return transfers(self.input_grads(p + 1, mb_size), self.outputs(p, mb_size))


def transfers(producers: list[Holding], consumers: list[Holding]) -> list[Transfer]:
    moves = []
    for prod in producers:
        for cons in consumers:
            block = intersect(prod.block, cons.block)
            if block is not None:
                moves.append(Transfer(prod.part, cons.part, block))
    return moves


def image_feed(layout: Layout, mb_size: int) -> list[Holding]:
    """What the coordinator sends to each part of the first stage: its input block of the
    image (uint8)."""
    return layout.inputs(0, mb_size)


def loss_holders(layout: Layout, mb_size: int) -> list[Holding]:
    """Parts of the last stage and the output block each computes the loss on."""
    return layout.outputs(len(layout.plan.stages) - 1, mb_size)
