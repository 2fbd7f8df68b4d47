"""Which layers one tiles stage can take, and how its maps connect (pure: no torch, no planner).

A tiles stage [first, last) need not be a chain. Beside the window layers (convolution, max-
and local average pooling, each reading the layer before) it takes the layers residual and
CSP blocks are made of, and upsampling:

    shortcut   maps of one shape added (then an activation): a residual block's join
    route      maps of one size side by side in channels; with groups/group_id each input's
               group_id-th part of its channels (a CSP block's split)
    upsample   nearest neighbour, each pixel repeated stride x stride times (a window layer
               here: it reads the layer before through an AxisWindow with `up`)

`stage_refusal` says in one line why a range cannot be one tiles stage (None: it can):
  - a layer of another kind (a head, a global pool, a grouped or dilated window, a shortcut
    adding maps of other shapes, darknet's subsampled add among them);
  - a map other than the one entering the stage is read inside it or crosses it
    (`live_after(first)` must be the map before the stage), or a map of the stage other than
    its last is read after it (`live_after(last)` must be its last map): a tiles stage takes
    in one map and passes on one, each cut into the same tiles as its neighbours' blocks;
  - a map of the stage that nothing in the stage reads;
  - a map its readers would cut apart differently. Ownership cuts start at the stage output
    and are carried down: a window moves a cut to its windows' centres
    (`AxisWindow.input_cut`), an upsample divides it by its stride, and a shortcut or route
    leaves it where it is (its inputs are cut as its output). Every reader of a map must put
    the map's cuts in the same place. Carried down as affine maps of the output's cuts
    (`_carried_cuts`), this is checked once for every grid; `tiles.layout.owned_cuts` checks
    a grid's actual cuts again (where the map's edges clip them).

`required_syncs`: boundary b (the map entering layer b) may lie inside a fused group only
where layers b - 1 and b are window layers and layer b alone reads the map; at every other
boundary of the stage (a graph layer on either side, or a map read twice) the tiles sync
both ways.
"""
from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Protocol

from tiles.regions import GRAPH_KINDS, LOCAL_KINDS, WINDOW_KINDS, LayerGeometry, LayerSpec, TilingError


class NetworkSpec(Protocol):
    """What the stage checks read of a whole network (the planner's ModelDesc is one)."""

    @property
    def layers(self) -> Sequence[LayerSpec]: ...  # in execution order

    def live_after(self, boundary: int) -> tuple[int, ...]:
        """Layers (or the image, -1) produced before `boundary` and read at or after it."""
        ...


def sources(d) -> tuple[int, ...]:
    """The layers whose maps a layer (LayerSpec or LayerGeometry) reads; -1 is the image."""
    return tuple(d.inputs) if getattr(d, "inputs", ()) else (d.index - 1,)


def plain_window(d: LayerSpec) -> bool:
    """A window with one stride on both axes, undilated and ungrouped: what tiles compute."""
    return (getattr(d, "groups", 1) == 1 and getattr(d, "dilation", 1) == 1
            and getattr(d, "stride_x", 0) in (0, d.stride))


def layer_refusal(d: LayerSpec, shape_of) -> str | None:
    """Why layer `d` cannot be in a tiles stage (None: it can); shape_of(i) is the (C, H, W)
    of layer i's map (-1: the image)."""
    where = f"layer {d.index} ({d.kind})"
    if d.kind in WINDOW_KINDS:
        if d.kernel <= 0:
            return f"{where} pools the whole map, which cannot be tiled"
        if not plain_window(d):
            return f"{where} is a grouped, dilated or two-stride window; tiles take plain windows"
        return None
    if d.kind == "upsample":
        return None if d.stride >= 1 else f"{where} does not enlarge"
    if d.kind not in GRAPH_KINDS:
        return (f"{where} cannot be tiled; tiles take convolution and local pooling layers, shortcuts, routes "
                "and upsamples")
    shapes = [tuple(shape_of(s)) for s in d.inputs]
    out = tuple(d.out_shape)
    if d.kind == "shortcut" and any(sh != out for sh in shapes):
        what = ", ".join(f"layer {s}'s {'x'.join(map(str, sh))}" for s, sh in zip(d.inputs, shapes))
        return f"{where} adds maps of other shapes ({what}); tiles take adds of maps of one shape"
    if any(sh[1:] != out[1:] for sh in shapes):
        return f"{where} joins maps of other sizes; tiles take routes of maps of one size"
    return None


def stage_geometries(descs: Sequence[LayerSpec]) -> list[LayerGeometry]:
    """The geometry of each layer of a stage (consecutive layers), each graph layer's inputs'
    shapes found from the layers that make them (the map entering the stage: from the first
    layer, which reads only it)."""
    if not descs:
        return []
    first = descs[0].index
    shapes = {d.index: tuple(d.out_shape) for d in descs}
    shapes[first - 1] = tuple(descs[0].in_shape)
    out = []
    for d in descs:
        srcs = sources(d)
        missing = [s for s in srcs if s not in shapes]
        if missing:
            raise TilingError(f"layer {d.index} reads layer {missing[0]}'s map from before the stage (layers "
                              f"{first}-{descs[-1].index}); a tiles stage takes in only the map before it")
        out.append(LayerGeometry.from_desc(d, [shapes[s] for s in srcs] if d.kind in GRAPH_KINDS else None))
    return out


def readers(layers: Sequence) -> dict[int, list[int]]:
    """Boundary b (the map of layer b - 1) -> the layers of the stage that read it, in order
    (a layer reading a map twice is listed twice)."""
    found: dict[int, list[int]] = {}
    for d in layers:
        for s in sources(d):
            found.setdefault(s + 1, []).append(d.index)
    return found


def required_syncs(layers: Sequence) -> tuple[int, ...]:
    """Boundaries inside the stage where its tiles must sync both ways: all but those between
    two window layers where the later alone reads the earlier's map."""
    if not layers:
        return ()
    by = {d.index: d for d in layers}
    first, last = layers[0].index, layers[-1].index + 1
    who = readers(layers)
    return tuple(b for b in range(first + 1, last)
                 if not (by[b - 1].kind in LOCAL_KINDS and by[b].kind in LOCAL_KINDS and who.get(b) == [b]))


def missing_syncs(layers: Sequence, forward: Sequence[int], backward: Sequence[int]) -> str | None:
    """Why a grouping does not sync where the stage's graph needs it, in one line (None: it does)."""
    need = required_syncs(layers)
    fwd = [b for b in need if b not in set(forward)]
    bwd = [b for b in need if b not in set(backward)]
    if not fwd and not bwd:
        return None

    def listed(bs: list[int]) -> str:
        shown = ", ".join(map(str, bs[:10]))
        return shown if len(bs) <= 10 else f"{shown}, ... ({len(bs)} in all)"

    if fwd == bwd:
        where = f"at {listed(fwd)} both ways"
    else:
        where = " and ".join(part for part in (f"at {listed(fwd)} forward" if fwd else "",
                                               f"at {listed(bwd)} backward" if bwd else "") if part)
    first, last = layers[0].index, layers[-1].index + 1
    return (f"layers {first}-{last - 1} hold shortcuts, routes or maps read twice, where a tiles stage syncs at "
            f"every layer: add syncs {where} (or sync at every layer: --sync all)")


def _axis_rule(d, axis: str) -> tuple[Fraction, Fraction]:
    """(a, c): a layer puts the input cut of an output cut x at a * x + c (before clipping)."""
    if d.kind in GRAPH_KINDS:
        return Fraction(1), Fraction(0)
    if d.kind == "upsample":
        return Fraction(1, d.stride), Fraction(0)
    left, _, top, _ = d.padding
    before = top if axis == "rows" else left
    return Fraction(d.stride), Fraction((d.kernel - 1) // 2 - before)


def _carried_cuts(layers: Sequence) -> str | None:
    """Why the stage's maps cannot each be cut one way (None: they can): every cut carried
    down from the output as an affine map of the output's cuts, per axis."""
    first, last = layers[0].index, layers[-1].index + 1
    carried: dict[int, tuple] = {last: ((Fraction(1), Fraction(0)),) * 2}
    by_whom: dict[int, int] = {}
    for d in reversed(layers):
        out = carried.get(d.index + 1)
        if out is None:
            return (f"layer {d.index}'s map is read by nothing in the stage; a tiles stage passes on only its "
                    "last map")
        rules = [_axis_rule(d, axis) for axis in ("rows", "cols")]
        mine = tuple((a * oa, a * ob + c) for (a, c), (oa, ob) in zip(rules, out))
        for s in sources(d):
            b = s + 1
            if b in carried and carried[b] != mine:
                what = f"layer {s}'s map" if b > first else "the stage input"
                return (f"{what} would be cut one way for layer {by_whom[b]} and another for layer {d.index}; "
                        "one tiles stage cannot own it both ways")
            carried[b], by_whom[b] = mine, d.index
    return None


def _reader_after(desc: NetworkSpec, src: int, boundary: int) -> str:
    for d in desc.layers[boundary:]:
        if src in sources(d):
            return f"layer {d.index}"
    return "the loss"


def stage_refusal(desc: NetworkSpec, first: int, last: int) -> str | None:
    """Why layers [first, last) of a network cannot be one tiles stage, in one line (None:
    they can, on any grid the maps are large enough for)."""
    layers = list(desc.layers[first:last])
    if not layers:
        return "a tiles stage needs at least one layer"

    def shape_of(i: int):
        return desc.layers[i].out_shape if i >= 0 else desc.layers[0].in_shape

    for d in layers:
        before = [s for s in sources(d) if s < first - 1]
        if before:
            return (f"layer {d.index} reads layer {before[0]}'s map from before the stage; a tiles stage takes in "
                    f"only the map before it" + (f" (layer {first - 1}'s)" if first > 0 else " (the image)"))
        reason = layer_refusal(d, shape_of)
        if reason is not None:
            return reason
    crossing = [s for s in desc.live_after(first) if s != first - 1]
    if crossing:
        s = crossing[0]
        return (f"layer {s}'s map crosses the stage to {_reader_after(desc, s, last)}; a tiles stage takes in and "
                "passes on one map")
    leaving = [s for s in desc.live_after(last) if s != last - 1]
    if leaving:
        s = leaving[0]
        return (f"layer {s}'s map inside the stage is read after it by {_reader_after(desc, s, last)}; a tiles "
                f"stage passes on only its last map (layer {last - 1}'s)")
    return _carried_cuts(layers)


def tileable_ends(desc: NetworkSpec) -> list[int]:
    """Every end e for which layers [0, e) can be one tiles stage, in order (kept with a
    description that keeps what it derives: planner.model_desc.ModelDesc.memo)."""
    if hasattr(desc, "memo"):
        return list(desc.memo("tileable_ends", lambda: _tileable_ends(desc)))
    return _tileable_ends(desc)


def _tileable_ends(desc: NetworkSpec) -> list[int]:
    layers = desc.layers

    def shape_of(i: int):
        return layers[i].out_shape if i >= 0 else layers[0].in_shape

    limit = 0  # the first layer no stage from 0 can take
    while limit < len(layers):
        d = layers[limit]
        if any(s < -1 for s in sources(d)) or layer_refusal(d, shape_of) is not None:
            break
        limit += 1
    # where each map is read last (the loss reads its heads after every layer): an end e
    # leaves only map e - 1 live when no earlier map is read at e or later
    read_last = {}
    for d in layers:
        for s in sources(d):
            read_last[s] = max(read_last.get(s, -1), d.index)
    for s in desc.live_after(len(layers)):
        read_last[s] = len(layers)
    ends, live_until = [], -1  # the latest reader of maps -1..e-2
    for e in range(1, limit + 1):
        live_until = max(live_until, read_last.get(e - 2, -1))
        if live_until < e and _carried_cuts(layers[:e]) is None:
            ends.append(e)
    return ends
