"""Cost model of a tiles stage for the planner: halo bytes, redundant FLOPs, activation memory, grouping choice.

Pure Python (no torch); every number is per sample unless it says otherwise, and comes
from the same StageLayout the executor runs, so the model counts what is executed.

    layout = build_layout(geoms, (2, 2), Grouping.parse("0,4,8", 0, 17), input_delta=False)
    cost = stage_cost(layout)
    cost.tiles[k].forward_recv[4]    # bytes tile k receives at the forward sync before layer 4
    cost.redundant_flops             # FLOPs all tiles do beyond the untiled stage (fwd + bwd)
    cost.max_peak_bytes              # the largest tile's activation memory (model)
    cost.step_time(flops_per_s=2e9, bytes_per_s=12.5e6, latency_s=5e-4, samples=4)

    choice = choose_grouping(desc.layers[0:17], grid=(2, 2), flops_per_s=2e9, bytes_per_s=12.5e6,
                             latency_s=5e-4, samples=4)
    choice.grouping.forward, choice.grouping.backward, choice.time_s, choice.cost

Signatures:
    stage_cost(layout: StageLayout) -> StageCost
    choose_grouping(layers: Sequence[LayerSpec | LayerGeometry], grid: (rows, cols), *,
                    flops_per_s: float, bytes_per_s: float, latency_s: float = 0.0,
                    samples: int = 1, input_delta: bool = False,
                    row_cuts=None, col_cuts=None) -> GroupingChoice
        `layers` are the stage's consecutive layers; `flops_per_s` is one tile's compute
        speed, `bytes_per_s` one tile's link, `latency_s` the cost of one synchronisation
        round (message latency), `samples` the micro-batch size. Groupings mirror forward
        and backward groups (as the paper does); the best is found exactly by dynamic
        programming over group boundaries, then costed exactly.

The time model per micro-batch: layers run in lockstep across tiles (BatchNorm sums make
every conv+BN layer a barrier), so compute is the sum over layers of the slowest tile's
FLOPs / flops_per_s; each sync where a window layer exchanges halos costs latency_s + the
largest bytes any tile sends or receives / bytes_per_s (max-pool selections inside backward
groups are one more round, one byte per window); each BatchNorm layer adds two all-reduces
of 2 x C float64. A stage over residual or CSP blocks counts its shortcuts and routes like
any layer: their FLOPs on each tile's owned pixels (they exchange nothing), a shortcut's
sum kept for its activation's backward, their inputs and output in the working set; the
grouping choice fuses only across the boundaries its graph allows (each graph layer is a
group of its own).

Activation memory per tile is modelled as what the executor keeps for backward (conv input
on the owned outputs' windows, conv output on the pointwise region, max-pool selections as
uint8) plus the largest forward working set (input, padded input and output of one layer).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tiles.grouping import Grouping
from tiles.layout import StageLayout, build_layout
from tiles.regions import WINDOW_KINDS, LayerGeometry, LayerSpec, Rect
from tiles.stage_graph import required_syncs, stage_geometries

BYTES_PER_FLOAT = 4  # maps and their gradients are float32, as the planner's model description counts them
INDEX_BYTES = 1  # max-pool selections are uint8 window positions
SUM_BYTES = 8  # BatchNorm sums travel as float64


@dataclass
class TileCost:
    tile: int
    forward_send: dict[int, int] = field(default_factory=dict)  # sync boundary -> bytes per sample
    forward_recv: dict[int, int] = field(default_factory=dict)
    backward_send: dict[int, int] = field(default_factory=dict)
    backward_recv: dict[int, int] = field(default_factory=dict)
    selection_send: dict[int, int] = field(default_factory=dict)  # max-pool output boundary -> bytes per sample
    selection_recv: dict[int, int] = field(default_factory=dict)
    input_bytes: int = 0  # the stage input rectangle it is sent
    layer_forward_flops: dict[int, float] = field(default_factory=dict)
    layer_backward_flops: dict[int, float] = field(default_factory=dict)
    saved_bytes: int = 0  # kept from forward to backward
    peak_bytes: int = 0  # saved + largest forward working set

    @property
    def forward_flops(self) -> float:
        return sum(self.layer_forward_flops.values())

    @property
    def backward_flops(self) -> float:
        return sum(self.layer_backward_flops.values())

    @property
    def halo_bytes(self) -> int:
        """Bytes sent plus received at all syncs, both directions."""
        return sum(sum(d.values()) for d in (self.forward_send, self.forward_recv, self.backward_send,
                                              self.backward_recv, self.selection_send, self.selection_recv))


@dataclass
class StageCost:
    layout: StageLayout
    tiles: list[TileCost]
    untiled_flops: float  # forward + backward of the stage untiled
    bn_channels: list[int]  # channels of each BatchNorm layer (one all-reduce each way)

    @property
    def total_flops(self) -> float:
        return sum(t.forward_flops + t.backward_flops for t in self.tiles)

    @property
    def redundant_flops(self) -> float:
        return self.total_flops - self.untiled_flops

    @property
    def max_peak_bytes(self) -> int:
        return max(t.peak_bytes for t in self.tiles)

    def compute_time(self, flops_per_s: float, samples: int = 1) -> float:
        layers = range(self.layout.first, self.layout.last)
        slowest = sum(max(t.layer_forward_flops[l] + t.layer_backward_flops[l] for t in self.tiles) for l in layers)
        return slowest * samples / flops_per_s

    def comm_time(self, bytes_per_s: float, latency_s: float = 0.0, samples: int = 1) -> float:
        lay = self.layout
        total = 0.0
        if lay.n_tiles > 1:
            for b in lay.forward_transfers:  # the syncs where a window layer exchanges (not a graph layer's)
                worst = max(max(t.forward_send.get(b, 0), t.forward_recv.get(b, 0)) for t in self.tiles)
                total += latency_s + worst * samples / bytes_per_s
            for b in lay.backward_transfers:
                worst = max(max(t.backward_send.get(b, 0), t.backward_recv.get(b, 0)) for t in self.tiles)
                total += latency_s + worst * samples / bytes_per_s
            for b in self.layout.selection_transfers:
                worst = max(max(t.selection_send.get(b, 0), t.selection_recv.get(b, 0)) for t in self.tiles)
                total += latency_s + worst * samples / bytes_per_s
            for c in self.bn_channels:
                total += 2 * (latency_s + 2 * c * SUM_BYTES / bytes_per_s)
        return total

    def step_time(self, flops_per_s: float, bytes_per_s: float, latency_s: float = 0.0, samples: int = 1) -> float:
        """Predicted seconds for one micro-batch of `samples` through the stage, forward and backward."""
        return self.compute_time(flops_per_s, samples) + self.comm_time(bytes_per_s, latency_s, samples)


def _map_bytes(rect: Rect, channels: int, per: int = BYTES_PER_FLOAT) -> int:
    return rect.area * channels * per


def _padded_area(g: LayerGeometry, out: Rect) -> int:
    """Area of the padded input that outputs `out` read."""
    if out.empty:
        return 0
    rows = (out.rows.size - 1) * g.rows.stride + g.rows.kernel
    cols = (out.cols.size - 1) * g.cols.stride + g.cols.kernel
    return rows * cols


def stage_cost(layout: StageLayout) -> StageCost:
    lay = layout
    tiles = []
    for t in lay.tiles:
        c = TileCost(t.tile, input_bytes=_map_bytes(t.input_rect, lay.map_shape(lay.first)[0]))
        for table, send, recv, per in ((lay.forward_transfers, c.forward_send, c.forward_recv, BYTES_PER_FLOAT),
                                       (lay.backward_transfers, c.backward_send, c.backward_recv, BYTES_PER_FLOAT),
                                       (lay.selection_transfers, c.selection_send, c.selection_recv, INDEX_BYTES)):
            for b, transfers in table.items():
                ch = lay.map_shape(b)[0]
                send[b] = sum(_map_bytes(tr.rect, ch, per) for tr in transfers if tr.src == t.tile)
                recv[b] = sum(_map_bytes(tr.rect, ch, per) for tr in transfers if tr.dst == t.tile)
        working = 0
        for g in lay.layers:
            l, px = g.index, g.flops_per_output_pixel
            c.layer_forward_flops[l] = px * t.fwd_out[l + 1].area
            dx = px * t.bwd_in[l].area if not t.bwd_delta[l].empty else 0.0
            c.layer_backward_flops[l] = dx + (px * t.own[l + 1].area if g.has_weights else 0.0)
            if g.kind == "conv":
                c.saved_bytes += _padded_area(g, t.own[l + 1]) * g.in_channels * BYTES_PER_FLOAT
                if g.pointwise_state:
                    c.saved_bytes += _map_bytes(t.bwd_state[l], g.out_channels)
            elif g.kind == "maxpool":
                c.saved_bytes += _map_bytes(t.bwd_state[l], g.out_channels, INDEX_BYTES)
            elif g.kind == "shortcut" and g.pointwise_state:
                c.saved_bytes += _map_bytes(t.bwd_state[l], g.out_channels)
            if g.graph:  # its inputs on its owned pixels, and its output
                step = sum(_map_bytes(t.own[l + 1], lay.map_shape(b)[0]) for b in g.reads) \
                    + 2 * _map_bytes(t.fwd_out[l + 1], g.out_channels)
            else:
                padded = _padded_area(g, t.fwd_out[l + 1]) if g.kind in WINDOW_KINDS else 0
                step = (_map_bytes(t.fwd_in[l][0], g.in_channels) + padded * g.in_channels * BYTES_PER_FLOAT
                        + 2 * _map_bytes(t.fwd_out[l + 1], g.out_channels))
            working = max(working, step)
        c.peak_bytes = c.saved_bytes + working
        tiles.append(c)
    untiled = 0.0
    for i, g in enumerate(lay.layers):
        untiled += g.flops  # forward
        needs_dx = lay.input_delta or i > 0
        untiled += (g.flops if needs_dx else 0.0) + (g.flops if g.has_weights else 0.0)
    return StageCost(lay, tiles, untiled, [g.out_channels for g in lay.layers if g.batch_norm])


@dataclass
class GroupingChoice:
    grouping: Grouping
    time_s: float  # predicted per micro-batch
    cost: StageCost


def _geometries(layers: Sequence[LayerSpec | LayerGeometry]) -> list[LayerGeometry]:
    if all(isinstance(g, LayerGeometry) for g in layers):
        return list(layers)
    return stage_geometries(list(layers))


def choose_grouping(layers: Sequence[LayerSpec | LayerGeometry], grid: tuple[int, int], *, flops_per_s: float,
                    bytes_per_s: float, latency_s: float = 0.0, samples: int = 1, input_delta: bool = False,
                    row_cuts: list[int] | None = None, col_cuts: list[int] | None = None) -> GroupingChoice:
    """The (mirrored) grouping with the least predicted time per micro-batch; a group never
    spans a boundary where the stage's graph needs a sync (tiles.stage_graph.required_syncs)."""
    geoms = _geometries(layers)
    first, last = geoms[0].index, geoms[-1].index + 1
    full = build_layout(geoms, grid, Grouping.every_layer(first, last), input_delta, row_cuts, col_cuts)
    every = stage_cost(full)
    required = set(required_syncs(geoms))
    cost = {}
    for s in range(first, last):
        for e in range(s + 1, last + 1):
            if any(b in required for b in range(s + 1, e)):
                break  # a later end spans the same sync
            if geoms[s - first].graph:  # a shortcut or route alone: its owned pixels, no halo
                slowest = max(t.layer_forward_flops[s] + t.layer_backward_flops[s] for t in every.tiles)
                cost[(s, e)] = slowest * samples / flops_per_s
                continue
            sub = build_layout(geoms[s - first:e - first], grid, Grouping.one_group(s, e), input_delta or s > first,
                               full.row_cuts[e], full.col_cuts[e])
            sc = stage_cost(sub)
            t = sc.compute_time(flops_per_s, samples) + sc.comm_time(bytes_per_s, latency_s, samples)
            if s > first and full.n_tiles > 1:  # the forward halo at s: what the group reads beyond its own pixels
                ch = full.map_shape(s)[0]
                recv = max(_map_bytes(tl.fwd_in[s][0], ch) - _map_bytes(full.tiles[k].own[s], ch)
                           for k, tl in enumerate(sub.tiles))
                t += latency_s + recv * samples / bytes_per_s
            cost[(s, e)] = t
    best = {first: (0.0, [])}
    for e in range(first + 1, last + 1):
        best[e] = min((best[s][0] + cost[(s, e)], best[s][1] + [s]) for s in range(first, e) if (s, e) in cost)
    grouping = Grouping.make(first, last, best[last][1])
    final = stage_cost(build_layout(geoms, grid, grouping, input_delta, row_cuts, col_cuts))
    return GroupingChoice(grouping, final.step_time(flops_per_s, bytes_per_s, latency_s, samples), final)
