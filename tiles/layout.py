"""The layout of a tiles stage: what every tile owns, computes, keeps and exchanges (pure data).

Built from the layers' geometry, a grid and a grouping; no torch, so the planner, the
cost model, the data feeder and the distributed driver all read the same numbers.

Maps. The stage's layers may form a graph (tiles.stage_graph: residual and CSP blocks,
whose shortcuts and routes read earlier maps of the stage). Boundary b is the map of layer
b - 1 (b = first: the map entering the stage); each layer reads the boundaries of its
inputs (`LayerGeometry.reads`), a window layer always the one before it. The stage takes
in one map and passes on one: nothing else enters, nothing else leaves.

Ownership. The stage output (boundary `last`) is cut evenly into rows x cols (or at given
cuts, e.g. in proportion to device speed); every earlier map is cut by its readers: a
window reader where the windows above it are centred (`AxisWindow.input_cut`), so a 2x2/2
max-pool needs no halo; an upsample at its output cuts over its stride; a shortcut or
route where its output is cut, so that it reads each input at its own pixels. A map read
by several layers must get the same cuts from all of them (else TilingError: the stage is
not tileable there). Tile k = row * cols + col owns `own[b]` at each boundary. Ownership
decides who supplies a halo pixel, and which pixels each tile counts in BatchNorm sums and
partial weight gradients (never a pixel twice).

Graph parts sync at every layer. A forward or backward group may run across boundary b
only where layers b - 1 and b are window layers and layer b alone reads map b
(`tiles.stage_graph.required_syncs`); every other boundary of the stage is a sync both ways,
which the grouping must include. There a shortcut or route computes exactly its owned
pixels from its inputs' owned pixels (same cuts: no halo, forward or backward), and the
window layers exchange input halos forward and gradient halos backward as in a chain
synced at every layer. A map read by several layers gets its gradient, on its owned
pixels, as the sum of what each reader gives back.

Backward (computed first, because the forward pass must keep what it needs):
  bwd_delta[b]  region of dL/d(map b) the tile computes. At a backward sync (and at the
                bottom of the stage) it is just `own[b]`; inside a backward group it grows
                upwards (eq. 2a-2d, clipped) so the group's bottom comes out exact.
  bwd_in[l]     region of the gradient at layer l's window output (after BatchNorm and the
                activation have been back-propagated) that layer l's window backward reads:
                the outputs touching bwd_delta[l]; a graph layer's own output pixels. At a
                backward sync l+1 the part outside `own[l+1]` arrives from the neighbours
                that own it (`backward_transfers`): halos carry gradients *below* the
                pointwise ops, so the owner alone runs BatchNorm and activation backward on
                its pixels.
  bwd_state[l]  region of layer l's output whose forward values its backward needs: the
                pointwise region for conv+BN/activation (own at a sync, bwd_delta inside a
                group), a shortcut's owned pixels when an activation follows the add; for
                a max-pool, the windows it routes (bwd_in) and owns.
  selection     a max-pool window is routed by the selection its *owner* made: tiles that
                evaluated it redundantly (from sums that may round differently in the last
                bit, which decides exact ties) receive the owner's choice, one byte per
                window and channel (`selection_transfers`, keyed by the pool's output
                boundary), just before that pool's backward. So every tile routes a window's
                gradient to the same input, as the untiled pool does.
Forward:
  fwd_out[b]    region of map b that layer b-1 computes: own, plus the next layer's input
                inside a forward group, plus bwd_state.
  fwd_in[l]     (rect, border padding) a window layer l reads (eq. 1a-1d, clipped); a graph
                layer reads each input on its own output pixels. At `first` the tile's
                input rectangle (`input`: what every reader of the stage input needs) is
                sent by whoever feeds the stage; at another forward sync the part outside
                fwd_out arrives from its owners (`forward_transfers`).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from tiles.grouping import Grouping
from tiles.regions import EMPTY_RECT, LayerGeometry, Padding, Rect, TilingError, cut_spans, even_cuts
from tiles.stage_graph import NetworkSpec, missing_syncs, plain_window, tileable_ends

__all__ = ["NetworkSpec", "StageLayout", "TileRegions", "Transfer", "build_layout", "plain_window",
           "tileable_prefix"]

Shape = tuple[int, int, int]


@dataclass(frozen=True)
class Transfer:
    """Tile `src` sends `rect` (map coordinates) of its owned pixels to tile `dst`."""

    src: int
    dst: int
    rect: Rect


@dataclass
class TileRegions:
    """One tile's regions, keyed by boundary (maps) or layer index."""

    tile: int
    own: dict[int, Rect] = field(default_factory=dict)  # boundary first..last
    fwd_out: dict[int, Rect] = field(default_factory=dict)  # boundary first+1..last
    fwd_in: dict[int, tuple[Rect, Padding]] = field(default_factory=dict)  # layer first..last-1
    bwd_delta: dict[int, Rect] = field(default_factory=dict)  # boundary first..last-1
    bwd_in: dict[int, Rect] = field(default_factory=dict)  # layer first..last-1
    bwd_state: dict[int, Rect] = field(default_factory=dict)  # layer first..last-1
    input: Rect = EMPTY_RECT  # the stage input it is sent: what all readers of the first map need

    @property
    def input_rect(self) -> Rect:
        """The rectangle of the stage input this tile needs (owned part plus halo)."""
        return self.input


@dataclass
class StageLayout:
    layers: list[LayerGeometry]
    grid: tuple[int, int]
    grouping: Grouping
    input_delta: bool  # does the stage produce dL/d(input) (False for the first stage)
    row_cuts: dict[int, list[int]]  # boundary -> rows + 1 cut positions
    col_cuts: dict[int, list[int]]
    tiles: list[TileRegions]
    forward_transfers: dict[int, list[Transfer]]  # forward sync boundary (> first, read by a window) -> transfers
    backward_transfers: dict[int, list[Transfer]]  # backward sync boundary -> transfers
    selection_transfers: dict[int, list[Transfer]]  # max-pool output boundary -> window selections
    shapes: dict[int, Shape] = field(default_factory=dict)  # boundary -> (C, H, W) of its map
    readers: dict[int, list[int]] = field(default_factory=dict)  # boundary -> the layers reading it, in order

    @property
    def first(self) -> int:
        return self.grouping.first

    @property
    def last(self) -> int:
        return self.grouping.last

    @property
    def n_tiles(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def is_chain(self) -> bool:
        """Each layer reads only the one before, and only it reads that map."""
        return all(g.reads == (g.index,) and self.readers.get(g.index) == [g.index] for g in self.layers)

    def layer(self, index: int) -> LayerGeometry:
        return self.layers[index - self.first]

    def map_shape(self, boundary: int) -> tuple[int, int, int]:
        """(C, H, W) of the map entering layer `boundary` (the stage output at `last`)."""
        return self.shapes[boundary]

    def output_rect(self, tile: int) -> Rect:
        return self.tiles[tile].own[self.last]

    def input_rect(self, tile: int) -> Rect:
        return self.tiles[tile].input_rect

    def delta_out_rect(self, tile: int) -> Rect:
        """The part of dL/d(stage input) this tile produces (its owned part)."""
        return self.tiles[tile].own[self.first] if self.input_delta else EMPTY_RECT

    def table(self, phase: str) -> dict[int, list[Transfer]]:
        return {"forward": self.forward_transfers, "backward": self.backward_transfers,
                "selection": self.selection_transfers}[phase]

    def transfers_into(self, phase: str, boundary: int, tile: int) -> list[Transfer]:
        return [t for t in self.table(phase).get(boundary, []) if t.dst == tile]

    def transfers_from(self, phase: str, boundary: int, tile: int) -> list[Transfer]:
        return [t for t in self.table(phase).get(boundary, []) if t.src == tile]

    def neighbours(self, tile: int) -> list[int]:
        """Tiles this one exchanges halos with, either way, at any sync."""
        found = set()
        for table in (self.forward_transfers, self.backward_transfers, self.selection_transfers):
            for ts in table.values():
                for t in ts:
                    if t.src == tile:
                        found.add(t.dst)
                    elif t.dst == tile:
                        found.add(t.src)
        return sorted(found)

    def to_dict(self) -> dict:
        """JSON-able summary for a distributed driver or a picture."""
        def transfers(table):
            return {str(b): [{"src": t.src, "dst": t.dst, "rect": t.rect.to_list()} for t in ts]
                    for b, ts in table.items()}
        return {"first": self.first, "last": self.last, "grid": list(self.grid), **self.grouping.to_dict(),
                "input_delta": self.input_delta,
                "tiles": [{"input": self.input_rect(k).to_list(), "output": self.output_rect(k).to_list(),
                           "own": {str(b): r.to_list() for b, r in t.own.items()}}
                          for k, t in enumerate(self.tiles)],
                "forward_transfers": transfers(self.forward_transfers),
                "backward_transfers": transfers(self.backward_transfers),
                "selection_transfers": transfers(self.selection_transfers)}


def tileable_prefix(desc: NetworkSpec) -> int:
    """The end (exclusive) of the longest run of layers from 0 that one tiles stage can take
    (tiles.stage_graph.stage_refusal: windows, shortcuts, routes and upsamples, whose maps
    nothing after the stage reads except its output). 0 when the first layer cannot be tiled."""
    ends = tileable_ends(desc)
    return ends[-1] if ends else 0


def check_stage(layers: list[LayerGeometry]) -> tuple[dict[int, Shape], dict[int, list[int]]]:
    """The shape of every map of the stage and who reads it; raises TilingError where the
    layers do not make one stage (not consecutive, reading from before it, shapes that
    do not match, a map nothing reads)."""
    first, last = layers[0].index, layers[-1].index + 1
    shapes: dict[int, Shape] = {}
    readers: dict[int, list[int]] = {}
    for i, g in enumerate(layers):
        if g.index != first + i:
            raise TilingError(f"layers {layers[i - 1].index} and {g.index} are not consecutive")
        for k, b in enumerate(g.reads):
            if b < first or b > g.index:
                raise TilingError(f"layer {g.index} reads layer {b - 1}'s map from outside the stage (layers "
                                  f"{first}-{last - 1}); a tiles stage takes in only the map before it")
            if g.graph:
                want = (g.channel_parts[k][0] if g.channel_parts else g.out_channels, g.rows.size_in, g.cols.size_in)
            else:
                want = (g.in_channels, g.rows.size_in, g.cols.size_in)
            if b == first and b not in shapes:
                shapes[b] = want
            if shapes[b] != want:
                what = f"layer {b - 1}'s output" if b > first else "the stage input"
                raise TilingError(f"layer {g.index} reads {what} as {want}, but it is {shapes[b]}")
            readers.setdefault(b, []).append(g.index)
        shapes[g.index + 1] = (g.out_channels, g.rows.size_out, g.cols.size_out)
    unread = [b - 1 for b in range(first + 1, last) if b not in readers]
    if unread:
        raise TilingError(f"layer {unread[0]}'s map is read by nothing in the stage; a tiles stage passes on only "
                          "its last map")
    return shapes, readers


def owned_cuts(layers: list[LayerGeometry], parts: int, axis: str, top_cuts: list[int] | None) -> dict[int, list[int]]:
    """Cuts at every boundary: the stage output split evenly (or at `top_cuts`), then carried
    down by each map's readers (window centres; a graph layer's inputs as its output)."""
    first, last = layers[0].index, layers[-1].index + 1
    top = layers[-1].rows.size_out if axis == "rows" else layers[-1].cols.size_out
    cuts = {last: list(top_cuts) if top_cuts is not None else even_cuts(top, parts)}
    if len(cuts[last]) != parts + 1 or cuts[last][0] != 0 or cuts[last][-1] != top:
        raise TilingError(f"{axis} cuts {cuts[last]} must run from 0 to {top} in {parts} pieces")
    cut_by: dict[int, int] = {}
    for g in reversed(layers):
        win = g.rows if axis == "rows" else g.cols
        out = cuts[g.index + 1]
        below = list(out) if g.graph else [win.input_cut(c) for c in out]
        for b in g.reads:
            if b in cuts and cuts[b] != below:
                what = f"layer {b - 1}'s map" if b > first else "the stage input"
                raise TilingError(f"{what} is read by layers {g.index} and {cut_by[b]}, which cut its {axis} at "
                                  f"{below} and {cuts[b]}; one tiles stage cannot own it both ways")
            cuts[b], cut_by[b] = below, g.index
    for b in range(last, first - 1, -1):
        c = cuts[b]
        if any(y <= x for x, y in zip(c, c[1:])):
            where = f"layer {b - 1}'s output" if b > first else "the stage input"
            raise TilingError(f"a grid with {parts} {axis} does not fit: {where} has only {c[-1]} {axis} "
                              f"(some tile would own none); use fewer {axis} or a larger image")
    return cuts


def build_layout(layers: list[LayerGeometry], grid: tuple[int, int], grouping: Grouping, input_delta: bool,
                 row_cuts: list[int] | None = None, col_cuts: list[int] | None = None) -> StageLayout:
    """The full layout of a tiles stage; raises TilingError when it cannot be tiled."""
    rows, cols = grid
    if rows < 1 or cols < 1:
        raise TilingError(f"a grid needs at least one row and one column, got {rows}x{cols}")
    if not layers:
        raise TilingError("a tiles stage needs at least one layer")
    shapes, readers = check_stage(layers)
    first, last = layers[0].index, layers[-1].index + 1
    if (grouping.first, grouping.last) != (first, last):
        raise TilingError(f"the grouping is for layers {grouping.first}-{grouping.last - 1}, "
                          f"the stage is layers {first}-{last - 1}")
    reason = missing_syncs(layers, grouping.forward, grouping.backward)
    if reason is not None:
        raise TilingError(reason)
    rcuts = owned_cuts(layers, rows, "rows", row_cuts)
    ccuts = owned_cuts(layers, cols, "cols", col_cuts)
    geo = {g.index: g for g in layers}
    tiles = []
    for r in range(rows):
        for c in range(cols):
            t = TileRegions(r * cols + c)
            for b in range(first, last + 1):
                t.own[b] = Rect(cut_spans(rcuts[b])[r], cut_spans(ccuts[b])[c])
            _backward_regions(t, geo, grouping, input_delta)
            _forward_regions(t, geo, grouping)
            for l in readers[first]:
                t.input = t.input.hull(t.own[first] if geo[l].graph else t.fwd_in[l][0])
            tiles.append(t)

    def transfers(b, need_of, have_of):
        return _transfers(tiles, b, need_of, have_of, rcuts[b], ccuts[b])

    fwd = {b: transfers(b, lambda t, b=b: t.fwd_in[b][0], lambda t, b=b: t.fwd_out[b])
           for b in grouping.forward if b > first and not geo[b].graph}
    bwd = {b: transfers(b, lambda t, b=b: t.bwd_in[b - 1], lambda t, b=b: t.own[b])
           for b in grouping.backward if not geo[b - 1].graph}
    sel = {}
    for g in layers:
        if g.kind == "maxpool":
            b = g.index + 1
            found = transfers(b, lambda t, b=b: t.bwd_in[b - 1], lambda t, b=b: t.own[b])
            if found:
                sel[b] = found
    return StageLayout(layers, grid, grouping, input_delta, rcuts, ccuts, tiles, fwd, bwd, sel, shapes, readers)


def _backward_regions(t: TileRegions, geo: dict[int, LayerGeometry], grouping: Grouping, input_delta: bool) -> None:
    syncs = set(grouping.backward)
    first = grouping.first
    for s, e in grouping.backward_groups():
        cur = t.own[s] if (s > first or input_delta) else EMPTY_RECT
        t.bwd_delta[s] = cur
        for b in range(s + 1, e + 1):
            g = geo[b - 1]
            if g.graph:  # alone in its group: its owned output, unless nothing below takes a delta
                wanted = any(r > first or input_delta for r in g.reads)
                need = t.own[b] if wanted else EMPTY_RECT
            else:
                need = g.outputs_touching(cur)
            t.bwd_in[b - 1] = need
            if b == e:
                break
            cur = need.hull(t.own[b]) if g.has_weights else need
            t.bwd_delta[b] = cur
    for l, g in geo.items():
        if g.pointwise_state:
            t.bwd_state[l] = t.own[l + 1] if l + 1 in syncs else t.bwd_delta[l + 1]
        elif g.kind == "maxpool":  # the windows it routes, and those it owns (whose selection others may ask for)
            t.bwd_state[l] = t.bwd_in[l].hull(t.own[l + 1])
        else:
            t.bwd_state[l] = EMPTY_RECT


def _forward_regions(t: TileRegions, geo: dict[int, LayerGeometry], grouping: Grouping) -> None:
    syncs = set(grouping.forward)
    for l in sorted(geo, reverse=True):
        g = geo[l]
        out = t.own[l + 1]
        if l + 1 < grouping.last and l + 1 not in syncs:  # read by the window layer l + 1 alone
            out = out.hull(t.fwd_in[l + 1][0])
        out = out.hull(t.bwd_state[l])
        t.fwd_out[l + 1] = out
        t.fwd_in[l] = (out, Padding()) if g.graph else g.input_need(out)


def _transfers(tiles: list[TileRegions], boundary: int, need_of, have_of, row_cuts: list[int],
               col_cuts: list[int]) -> list[Transfer]:
    """Each tile receives the part of `need_of(tile)` outside `have_of(tile)` from its owners
    (found from the cuts of the boundary's map, in tile order)."""
    out = []
    cols = len(col_cuts) - 1
    for t in tiles:
        for piece in need_of(t).minus(have_of(t)):
            for r in _owners(row_cuts, piece.rows):
                for c in _owners(col_cuts, piece.cols):
                    n = tiles[r * cols + c]
                    if n.tile != t.tile:
                        part = piece.meet(n.own[boundary])
                        if not part.empty:
                            out.append(Transfer(n.tile, t.tile, part))
    return out


def _owners(cuts: list[int], span) -> range:
    """The tiles along one axis whose owned pixels (between consecutive cuts) meet `span`."""
    return range(max(0, bisect_right(cuts, span.lo) - 1), min(len(cuts) - 1, bisect_left(cuts, span.hi)))
