"""Tiling geometry without torch: window regions against brute force, layouts' invariants, groupings, grids."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.zoo import describe_model
from tests.conftest import ROOT
from tiles.grouping import Grouping, parse_grid
from tiles.layout import NetworkSpec, build_layout, tileable_prefix
from tiles.regions import AxisWindow, LayerGeometry, LayerSpec, Rect, Span, TilingError


def _window(kernel, stride, before, after, size_in):
    size_out = (size_in + before + after - kernel) // stride + 1
    return AxisWindow(kernel, stride, before, size_in, size_out)


windows = st.builds(
    _window, kernel=st.sampled_from([1, 2, 3, 5]), stride=st.sampled_from([1, 2, 3]),
    before=st.integers(0, 2), after=st.integers(0, 2), size_in=st.integers(5, 30),
).filter(lambda w: w.size_out >= 1 and w.before < w.kernel)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(win=windows, data=st.data())
def test_window_regions_match_brute_force(win, data):
    lo = data.draw(st.integers(0, win.size_out - 1))
    hi = data.draw(st.integers(lo + 1, win.size_out))
    reads = {o * win.stride - win.before + k for o in range(lo, hi) for k in range(win.kernel)}
    span, pad_before, pad_after = win.input_need(Span(lo, hi))  # the extent read, clipped, and what lies beyond
    assert (span.lo, span.hi) == (max(0, min(reads)), min(win.size_in, max(reads) + 1))
    assert (pad_before, pad_after) == (max(0, -min(reads)), max(0, max(reads) + 1 - win.size_in))
    a = data.draw(st.integers(0, win.size_in - 1))
    b = data.draw(st.integers(a + 1, win.size_in))
    touching = {o for o in range(win.size_out)
                if any(a <= o * win.stride - win.before + k < b for k in range(win.kernel))}
    got = win.outputs_touching(Span(a, b))
    assert set(range(got.lo, got.hi)) == touching


def test_rect_minus_is_a_disjoint_cover():
    outer, inner = Rect.of(0, 10, 0, 8), Rect.of(3, 12, -2, 5)
    pieces = outer.minus(inner)
    cells = [(r, c) for p in pieces for r in range(p.rows.lo, p.rows.hi) for c in range(p.cols.lo, p.cols.hi)]
    assert len(cells) == len(set(cells))
    assert set(cells) == {(r, c) for r in range(10) for c in range(8) if not (3 <= r and c < 5)}


def _stack_geometries(spec, size):
    """LayerGeometry list from (kind, kernel, stride, pad) tuples on a square map of `size`."""
    out, channels = [], 3
    for i, (kind, k, s, p) in enumerate(spec):
        before, after = (p, p) if kind != "maxpool" else (p // 2, p - p // 2)
        win = _window(k, s, before, after, size)
        geom = LayerGeometry(i, kind, win, win, channels, 4, has_weights=kind == "conv",
                             pointwise_state=kind == "conv", batch_norm=kind == "conv", flops=1000)
        out.append(geom)
        size, channels = win.size_out, 4
    return out


layer_specs = st.lists(st.one_of(
    st.tuples(st.just("conv"), st.sampled_from([1, 3, 5]), st.sampled_from([1, 2]), st.integers(0, 2)),
    st.tuples(st.just("maxpool"), st.sampled_from([2, 3]), st.sampled_from([1, 2]), st.integers(0, 2)),
    st.tuples(st.just("avgpool"), st.just(2), st.just(2), st.just(0)),
), min_size=1, max_size=6)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(spec=layer_specs, size=st.integers(9, 41), rows=st.integers(1, 4), cols=st.integers(1, 4),
       data=st.data(), input_delta=st.booleans())
def test_layouts_partition_maps_and_halos_cover_exactly_what_is_missing(spec, size, rows, cols, data, input_delta):
    try:
        geoms = _stack_geometries(spec, size)
    except ZeroDivisionError:
        return
    if any(g.rows.size_out < 1 or g.rows.kernel <= g.rows.before for g in geoms):
        return
    n = len(geoms)
    fwd = data.draw(st.sets(st.integers(0, n - 1)))
    bwd = data.draw(st.sets(st.integers(1, n)))
    grouping = Grouping.make(0, n, fwd, bwd)
    try:
        lay = build_layout(geoms, (rows, cols), grouping, input_delta)
    except TilingError as exc:
        assert "does not fit" in str(exc)
        return
    for b in range(n + 1):  # owned regions partition every map
        _, h, w = lay.map_shape(b)
        cells = [(r, c) for t in lay.tiles for r in range(t.own[b].rows.lo, t.own[b].rows.hi)
                 for c in range(t.own[b].cols.lo, t.own[b].cols.hi)]
        assert len(cells) == h * w == len(set(cells))
    for t in lay.tiles:
        for l, g in enumerate(geoms):
            assert t.fwd_out[l + 1].contains(t.own[l + 1]) and t.fwd_out[l + 1].contains(t.bwd_state[l])
            assert g.out_map.contains(t.fwd_out[l + 1]) and g.in_map.contains(t.fwd_in[l][0])
            assert t.bwd_in[l].contains(g.outputs_touching(t.bwd_delta[l]))
            if l + 1 < n and l + 1 not in grouping.forward:
                assert t.fwd_out[l + 1].contains(t.fwd_in[l + 1][0])
        pools = [g.index + 1 for g in geoms if g.kind == "maxpool"]
        for phase, syncs in (("forward", [b for b in grouping.forward if b > 0]), ("backward", grouping.backward),
                             ("selection", pools)):
            for b in syncs:
                need = t.fwd_in[b][0] if phase == "forward" else t.bwd_in[b - 1]
                have = t.fwd_out[b] if phase == "forward" else t.own[b]
                parts = [need.meet(have)] + [tr.rect for tr in lay.transfers_into(phase, b, t.tile)]
                cells = [(r, c) for p in parts for r in range(p.rows.lo, p.rows.hi) for c in range(p.cols.lo, p.cols.hi)]
                assert len(cells) == len(set(cells)) == need.area
                for tr in lay.transfers_into(phase, b, t.tile):
                    assert lay.tiles[tr.src].own[b].contains(tr.rect)


def test_aligned_ownership_needs_no_halo_at_2x2_max_pools():
    desc = describe_model("yolov2-16", 416)
    geoms = [LayerGeometry.from_desc(d) for d in desc.layers]
    lay = build_layout(geoms, (4, 4), Grouping.every_layer(0, 17), input_delta=False)
    pools = [d.index for d in desc.layers if d.kind == "maxpool"]
    assert pools == [1, 3, 7, 11]
    assert all(not lay.forward_transfers[b] for b in pools)
    assert all(lay.forward_transfers[b] for b in (2, 4, 6))  # 3x3 convs need a 1-pixel halo
    assert lay.row_cuts[17] == [0, 6, 13, 19, 26] and lay.row_cuts[0] == [0, 96, 208, 304, 416]
    t = lay.tiles[5]  # an inner tile: a halo of one pixel all round for a 3x3 conv
    assert t.fwd_in[2][0] == Rect.of(47, 105, 47, 105) and t.own[2] == Rect.of(48, 104, 48, 104)
    assert lay.neighbours(5) == [0, 1, 2, 4, 6, 8, 9, 10]


def test_one_group_grows_the_input_rectangle_and_every_layer_keeps_it_small():
    desc = describe_model("yolov2-16", 128)
    geoms = [LayerGeometry.from_desc(d) for d in desc.layers]
    every = build_layout(geoms, (2, 2), Grouping.every_layer(0, 17), input_delta=False)
    one = build_layout(geoms, (2, 2), Grouping.one_group(0, 17), input_delta=False)
    assert every.input_rect(0) == Rect.of(0, 65, 0, 65)
    assert one.input_rect(0).area > every.input_rect(0).area
    assert not one.forward_transfers and list(one.backward_transfers) == [17]


def test_grouping_defaults_parse_and_errors():
    g = Grouping.parse("0,4,8", 0, 17)
    assert g.forward == (0, 4, 8) and g.backward == (4, 8, 17)
    assert g.forward_groups() == [(0, 4), (4, 8), (8, 17)] and g.backward_groups() == [(0, 4), (4, 8), (8, 17)]
    assert Grouping.parse("4, 8", 0, 17).forward == (0, 4, 8)  # the stage input is always a sync
    assert Grouping.parse("all", 0, 3).forward == (0, 1, 2) and Grouping.parse("all", 0, 3).backward == (1, 2, 3)
    assert Grouping.parse("none", 0, 3).forward == (0,) and Grouping.parse("none", 0, 3).backward == (3,)
    assert g.to_dict() == {"syncs": [0, 4, 8], "back_syncs": [4, 8, 17]}
    with pytest.raises(TilingError, match="not in the tiles stage"):
        Grouping.parse("0,20", 0, 17)
    with pytest.raises(TilingError, match="not a layer number"):
        Grouping.parse("0,x", 0, 17)
    with pytest.raises(TilingError, match="must include the stage end"):
        Grouping(0, 17, (0,), (4,))


@pytest.mark.parametrize("text,grid", [("2x2", (2, 2)), ("2X3", (2, 3)), (" 4x1", (4, 1))])
def test_parse_grid(text, grid):
    assert parse_grid(text) == grid


@pytest.mark.parametrize("text", ["3", "0x2", "2x", "axb", "2x2x2", "-1x2"])
def test_parse_grid_rejects(text):
    with pytest.raises(TilingError):
        parse_grid(text)


def test_grid_too_fine_for_the_maps_is_a_clear_error():
    desc = describe_model("yolov2-16", 32)  # the last maps are 2x2
    geoms = [LayerGeometry.from_desc(d) for d in desc.layers]
    with pytest.raises(TilingError, match="grid with 3 rows does not fit: layer 16's output has only 2 rows"):
        build_layout(geoms, (3, 1), Grouping.every_layer(0, 17), input_delta=False)


def test_tileable_prefix_of_the_zoo():
    assert tileable_prefix(describe_model("yolov2-16")) == 17
    assert tileable_prefix(describe_model("yolov2")) == 17  # layer 16's map is routed to layer 25
    assert tileable_prefix(describe_model("vgg16")) == 18
    with pytest.raises(TilingError, match="cannot be tiled"):
        LayerGeometry.from_desc(describe_model("yolov2").layers[27])  # the reorg (its route at 25 is a graph layer)


def test_the_planners_descriptions_have_what_tiling_reads():
    """Tiles import nothing of the planner: its LayerDesc and ModelDesc must carry every member
    of LayerSpec and NetworkSpec."""
    desc = describe_model("yolov2-16")
    for spec, instance in ((LayerSpec, desc.layers[0]), (NetworkSpec, desc)):
        members = [name for name in vars(spec) if not name.startswith("_")]
        assert members and all(hasattr(instance, name) for name in members), (spec.__name__, members)


def test_pure_modules_do_not_import_torch():
    code = ("import sys, tiles, tiles.regions, tiles.grouping, tiles.layout, tiles.cost, tiles.requests, tiles.driver; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
