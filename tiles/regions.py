"""Region arithmetic for tiling: spans, rectangles, and what a layer's window needs and touches.

Pure Python (no torch): the planner imports it, never the other way; what tiling reads of
a layer's description is declared here (`LayerSpec`), and the planner's LayerDesc has all
of it. Coordinates are pixels of one feature map, half-open: a Span [lo, hi) on one axis, a
Rect = rows x cols. The map at boundary b is the one entering layer b (the image is
boundary 0).

For a window layer (convolution or pooling) with kernel k, stride s and padding
(before, after) on one axis, output pixel o reads input pixels [o*s - before, o*s - before + k);
an upsample by u (`AxisWindow.up`) has output pixel o read input pixel o // u. The pointwise
graph layers of a tiles stage (shortcut, route) read each input at the output's own pixels:
an axis of kernel 1 and stride 1. Two directions follow (the paper's equations 1a-1d and 2a-2d, generalised to any padding,
with clipping at the real border of the map instead of padding the map out):

    forward   input_need(outputs)   the input pixels a block of outputs reads, plus how much
                                    padding lies beyond the map on each side;
    backward  outputs_touching(inputs)  the outputs whose windows touch a block of inputs,
                                    i.e. the deltas needed to finish those inputs' deltas.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import NamedTuple, Protocol

WINDOW_KINDS = ("conv", "maxpool", "avgpool")
LOCAL_KINDS = WINDOW_KINDS + ("upsample",)  # one input, read through an AxisWindow (halos at syncs)
GRAPH_KINDS = ("shortcut", "route")  # several inputs, each read at the output's own pixels (no halos)


class LayerSpec(Protocol):
    """What tiling reads of one layer's description, for one sample (read-only; the
    planner's LayerDesc, built by the model zoo, is one)."""

    @property
    def index(self) -> int: ...
    @property
    def kind(self) -> str: ...  # a window layer is conv | maxpool | avgpool; also upsample, shortcut, route
    @property
    def in_shape(self) -> tuple[int, int, int]: ...  # (C, H, W) of its (first) input
    @property
    def out_shape(self) -> tuple[int, int, int]: ...  # (C, H, W)
    @property
    def inputs(self) -> tuple[int, ...]: ...  # the layers whose outputs it reads; -1 = the image
    @property
    def kernel(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def padding(self) -> tuple[int, int, int, int]: ...  # (left, right, top, bottom)
    @property
    def batch_normalize(self) -> bool: ...
    @property
    def activation(self) -> str: ...
    @property
    def flops(self) -> int: ...  # forward FLOPs per sample (a multiply-add is 2)
    @property
    def groups(self) -> int: ...  # conv: channel groups; route: each input's channels in this many parts
    @property
    def group_id(self) -> int: ...  # route: the part of each input it takes


class TilingError(ValueError):
    """A grid, grouping or layer range that cannot be tiled; the message says why."""


class Span(NamedTuple):
    """Pixels [lo, hi) on one axis; empty when hi <= lo. (A tuple: the planner builds
    hundreds of thousands of them while it chooses a grouping.)"""

    lo: int
    hi: int

    @property
    def size(self) -> int:
        return max(0, self.hi - self.lo)

    @property
    def empty(self) -> bool:
        return self.hi <= self.lo

    def hull(self, other: "Span") -> "Span":
        """The smallest span holding both (an empty span adds nothing)."""
        if self.empty:
            return other
        if other.empty:
            return self
        return Span(min(self.lo, other.lo), max(self.hi, other.hi))

    def meet(self, other: "Span") -> "Span":
        return Span(max(self.lo, other.lo), min(self.hi, other.hi))

    def contains(self, other: "Span") -> bool:
        return other.empty or (self.lo <= other.lo and other.hi <= self.hi)

    def minus(self, other: "Span") -> list["Span"]:
        """Self without other: up to two spans (below and above)."""
        if self.empty:
            return []
        inner = self.meet(other)
        if inner.empty:
            return [self]
        parts = [Span(self.lo, inner.lo), Span(inner.hi, self.hi)]
        return [p for p in parts if not p.empty]


EMPTY_SPAN = Span(0, 0)


class Rect(NamedTuple):
    """rows x cols of one map, both half-open."""

    rows: Span
    cols: Span

    @classmethod
    def of(cls, r0: int, r1: int, c0: int, c1: int) -> "Rect":
        return cls(Span(r0, r1), Span(c0, c1))

    @property
    def empty(self) -> bool:
        (r0, r1), (c0, c1) = self
        return r1 <= r0 or c1 <= c0

    @property
    def area(self) -> int:
        (r0, r1), (c0, c1) = self
        return 0 if r1 <= r0 or c1 <= c0 else (r1 - r0) * (c1 - c0)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.size, self.cols.size)

    def hull(self, other: "Rect") -> "Rect":
        if self.empty:
            return other
        if other.empty:
            return self
        return Rect(self.rows.hull(other.rows), self.cols.hull(other.cols))

    def meet(self, other: "Rect") -> "Rect":
        (r0, r1), (c0, c1) = self
        (s0, s1), (d0, d1) = other
        lo, hi, left, right = max(r0, s0), min(r1, s1), max(c0, d0), min(c1, d1)
        return EMPTY_RECT if hi <= lo or right <= left else Rect(Span(lo, hi), Span(left, right))

    def contains(self, other: "Rect") -> bool:
        return other.empty or (self.rows.contains(other.rows) and self.cols.contains(other.cols))

    def minus(self, other: "Rect") -> list["Rect"]:
        """Self without other as disjoint rectangles: full-width bands above and below
        `other`, then the pieces left and right of it."""
        if self.empty:
            return []
        inner = self.meet(other)
        if inner.empty:
            return [self]
        pieces = [Rect(r, self.cols) for r in self.rows.minus(inner.rows)]
        pieces += [Rect(inner.rows, c) for c in self.cols.minus(inner.cols)]
        return pieces

    def relative_to(self, origin: "Rect") -> tuple[slice, slice]:
        """Slices that cut this rect out of a tensor holding `origin` (rows, cols last)."""
        return (slice(self.rows.lo - origin.rows.lo, self.rows.hi - origin.rows.lo),
                slice(self.cols.lo - origin.cols.lo, self.cols.hi - origin.cols.lo))

    def to_list(self) -> list[int]:
        """[row0, row1, col0, col1] for JSON and messages."""
        return [self.rows.lo, self.rows.hi, self.cols.lo, self.cols.hi]


EMPTY_RECT = Rect(EMPTY_SPAN, EMPTY_SPAN)


@dataclass(frozen=True)
class Padding:
    """How many padding pixels a region needs beyond the real map: (top, bottom, left, right)."""

    top: int = 0
    bottom: int = 0
    left: int = 0
    right: int = 0

    @property
    def any(self) -> bool:
        return bool(self.top or self.bottom or self.left or self.right)

    def as_lrtb(self) -> tuple[int, int, int, int]:
        """(left, right, top, bottom): the order torch's F.pad takes for the last two dims."""
        return (self.left, self.right, self.top, self.bottom)


@dataclass(frozen=True)
class AxisWindow:
    """A layer's window along one axis."""

    kernel: int
    stride: int
    before: int  # padding before the first pixel
    size_in: int
    size_out: int
    up: int = 1  # an upsample: each input pixel becomes `up` output pixels (kernel and stride 1)

    def input_need(self, out: Span) -> tuple[Span, int, int]:
        """(input span inside the map, padding before it, padding after it) that outputs
        `out` read."""
        if out.empty:
            return EMPTY_SPAN, 0, 0
        if self.up > 1:
            return Span(out.lo // self.up, min(self.size_in, -(-out.hi // self.up))), 0, 0
        lo = out.lo * self.stride - self.before
        hi = (out.hi - 1) * self.stride - self.before + self.kernel
        return Span(max(0, lo), min(self.size_in, hi)), max(0, -lo), max(0, hi - self.size_in)

    def outputs_touching(self, inp: Span) -> Span:
        """The outputs whose windows overlap input span `inp` (clipped to the map)."""
        if inp.empty:
            return EMPTY_SPAN
        if self.up > 1:
            return Span(inp.lo * self.up, min(self.size_out, inp.hi * self.up))
        lo = -(-(inp.lo + self.before - self.kernel + 1) // self.stride)  # ceil
        hi = (inp.hi - 1 + self.before) // self.stride + 1
        return Span(max(0, lo), min(self.size_out, hi))

    def input_cut(self, out_cut: int) -> int:
        """Where a cut between output pixels out_cut-1 and out_cut falls in the input:
        before the input pixel under the centre of output out_cut's window."""
        if out_cut <= 0:
            return 0
        if out_cut >= self.size_out:
            return self.size_in
        if self.up > 1:
            return out_cut // self.up
        return min(self.size_in, max(0, out_cut * self.stride - self.before + (self.kernel - 1) // 2))


@dataclass(frozen=True)
class LayerGeometry:
    """One tileable layer as tiling sees it: a window over an (H, W) map (or, for a graph
    layer, a pointwise op over maps of one size), and what its backward needs from the
    forward pass."""

    index: int
    kind: str  # conv | maxpool | avgpool | upsample | shortcut | route
    rows: AxisWindow
    cols: AxisWindow
    in_channels: int  # of its first input
    out_channels: int
    has_weights: bool  # conv: partial weight gradients over owned outputs
    pointwise_state: bool  # BN or a non-linear activation after the window (or the add): backward needs the forward values
    batch_norm: bool
    flops: int  # forward FLOPs per sample over the whole map
    inputs: tuple[int, ...] = ()  # the layers whose maps it reads (-1: the image); (): the layer before
    channel_parts: tuple[tuple[int, int, int], ...] = ()  # route: per input (its channels, first, end of the part taken)

    @classmethod
    def from_desc(cls, d: LayerSpec, in_shapes: Sequence[tuple[int, int, int]] | None = None) -> "LayerGeometry":
        """A layer's geometry; a graph layer needs `in_shapes`, the (C, H, W) of each of its
        inputs, when they differ from its first (tiles.stage_graph.stage_geometries finds them)."""
        if d.kind in GRAPH_KINDS:
            return cls._graph(d, list(in_shapes) if in_shapes is not None else [tuple(d.in_shape)] * len(d.inputs))
        if d.kind == "upsample":
            c, h, w = d.in_shape
            _, oh, ow = d.out_shape
            s = d.stride
            if oh != h * s or ow != w * s:
                raise TilingError(f"layer {d.index} (upsample) takes {h}x{w} to {oh}x{ow}, not by its stride {s}")
            return cls(d.index, d.kind, AxisWindow(1, 1, 0, h, oh, up=s), AxisWindow(1, 1, 0, w, ow, up=s), c, c,
                       has_weights=False, pointwise_state=False, batch_norm=False, flops=d.flops, inputs=tuple(d.inputs))
        if d.kind not in WINDOW_KINDS or d.kernel <= 0:
            raise TilingError(f"layer {d.index} ({d.kind}) cannot be tiled; tiles take convolution and local pooling "
                              "layers, shortcuts, routes and upsamples")
        if getattr(d, "groups", 1) != 1 or getattr(d, "dilation", 1) != 1 or getattr(d, "stride_x", 0) not in (0, d.stride):
            raise TilingError(f"layer {d.index} ({d.kind}) cannot be tiled; tiles take ungrouped, undilated "
                              "windows with one stride on both axes")
        left, right, top, bottom = d.padding
        _, h, w = d.in_shape
        _, oh, ow = d.out_shape
        conv = d.kind == "conv"
        return cls(d.index, d.kind, AxisWindow(d.kernel, d.stride, top, h, oh),
                   AxisWindow(d.kernel, d.stride, left, w, ow), d.in_shape[0], d.out_shape[0],
                   has_weights=conv, pointwise_state=conv and (d.batch_normalize or d.activation != "linear"),
                   batch_norm=conv and d.batch_normalize, flops=d.flops, inputs=tuple(getattr(d, "inputs", ())))

    @classmethod
    def _graph(cls, d: LayerSpec, in_shapes: list[tuple[int, int, int]]) -> "LayerGeometry":
        c, h, w = d.out_shape
        if len(in_shapes) != len(d.inputs):
            raise TilingError(f"layer {d.index} ({d.kind}) reads {len(d.inputs)} maps, given {len(in_shapes)} shapes")
        sizes = {(sh[1], sh[2]) for sh in in_shapes}
        if sizes != {(h, w)}:
            what = ", ".join(f"layer {s}: {sh[1]}x{sh[2]}" for s, sh in zip(d.inputs, in_shapes))
            raise TilingError(f"layer {d.index} ({d.kind}) reads maps of other sizes than its {h}x{w} output ({what}); "
                              "tiles take graph layers over maps of one size")
        parts: tuple = ()
        if d.kind == "shortcut":
            if any(sh[0] != c for sh in in_shapes):
                what = ", ".join(f"layer {s}: {sh[0]}" for s, sh in zip(d.inputs, in_shapes))
                raise TilingError(f"layer {d.index} (shortcut) adds maps of other channels ({what}) to its {c}; "
                                  "tiles take adds of maps of one shape")
        else:
            groups, gid = getattr(d, "groups", 1), getattr(d, "group_id", 0)
            for sh in in_shapes:
                size = -(-sh[0] // groups)  # torch.chunk's parts
                parts += ((sh[0], min(sh[0], gid * size), min(sh[0], (gid + 1) * size)),)
            if sum(hi - lo for _, lo, hi in parts) != c:
                raise TilingError(f"layer {d.index} (route) joins {sum(hi - lo for _, lo, hi in parts)} channels, "
                                  f"its output has {c}")
        act = getattr(d, "activation", "linear")
        flat = AxisWindow(1, 1, 0, h, h), AxisWindow(1, 1, 0, w, w)
        return cls(d.index, d.kind, *flat, in_shapes[0][0], c, has_weights=False,
                   pointwise_state=d.kind == "shortcut" and act != "linear", batch_norm=False, flops=d.flops,
                   inputs=tuple(d.inputs), channel_parts=parts)

    @property
    def graph(self) -> bool:
        """A pointwise op over several maps (shortcut, route): it computes on owned pixels only."""
        return self.kind in GRAPH_KINDS

    @property
    def sources(self) -> tuple[int, ...]:
        """The layers whose maps it reads (-1: the image)."""
        return self.inputs or (self.index - 1,)

    @property
    def reads(self) -> tuple[int, ...]:
        """The boundaries it reads: boundary b is the map of layer b - 1 (0: the image)."""
        return tuple(s + 1 for s in self.sources)

    @property
    def in_map(self) -> Rect:
        return Rect.of(0, self.rows.size_in, 0, self.cols.size_in)

    @property
    def out_map(self) -> Rect:
        return Rect.of(0, self.rows.size_out, 0, self.cols.size_out)

    def input_need(self, out: Rect) -> tuple[Rect, Padding]:
        """Input rect (inside the map) and border padding that output rect `out` reads."""
        if out.empty:
            return EMPTY_RECT, Padding()
        rows, top, bottom = self.rows.input_need(out.rows)
        cols, left, right = self.cols.input_need(out.cols)
        return Rect(rows, cols), Padding(top, bottom, left, right)

    def outputs_touching(self, inp: Rect) -> Rect:
        if inp.empty:
            return EMPTY_RECT
        r = Rect(self.rows.outputs_touching(inp.rows), self.cols.outputs_touching(inp.cols))
        return EMPTY_RECT if r.empty else r

    @property
    def flops_per_output_pixel(self) -> float:
        return self.flops / max(1, self.rows.size_out * self.cols.size_out)


def even_cuts(size: int, parts: int) -> list[int]:
    """parts + 1 cut positions splitting [0, size) into near-equal pieces (sizes differ by <= 1)."""
    return [(i * size) // parts for i in range(parts + 1)]


def cut_spans(cuts: list[int]) -> list[Span]:
    return [Span(a, b) for a, b in zip(cuts, cuts[1:])]
