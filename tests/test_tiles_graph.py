"""Tiles stages over residual and CSP blocks: tiled == untiled, a stage at a time and after real
SGD steps, in float64 at odd input sizes; the ranges tiles refuse, and why.

The networks are darknet's own blocks, cut down to a few layers and narrow maps: resnet18's
front (a 7x7/2 convolution, a max-pool, two residual blocks) and yolov4-tiny's first CSP
block (half the channels routed through two convolutions and joined back), then a max-pool,
an upsample and a convolution, each before a small classifier."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.model_desc import LayerDesc, ModelDesc
from planner.plan import Plan, Stage
from swarm.errors import SwarmError
from swarm.local.trainer import TrainConfig
from swarm.zoo import build_model, describe_model
from tests.tiles_reference import rel_diff, train_float64, worst_state_diff
from tiles.grouping import Grouping
from tiles.layout import build_layout, tileable_prefix
from tiles.regions import TilingError
from tiles.stage_graph import required_syncs, stage_geometries, stage_refusal, tileable_ends
from tiles.whole_stage import InProcessStage

TOL = 1e-9


def _conv(filters: int, size: int, stride: int, act: str = "leaky", bn: bool = True) -> str:
    return (f"[convolutional]\nbatch_normalize={int(bn)}\nfilters={filters}\nsize={size}\nstride={stride}\npad=1\n"
            f"activation={act}\n")


CLASSIFIER = "[avgpool]\n\n" + _conv(1000, 1, 1, "linear", bn=False) + "\n[softmax]\ngroups=1\n"
HEAD = "[net]\nwidth=64\nheight=64\nchannels=3\n\n"
# resnet18's front: layers 0-7 (conv 7x7/2, max-pool 2/2, two residual blocks), a classifier at 8-9
RESNET_FRONT = HEAD + "\n".join([
    _conv(8, 7, 2), "[maxpool]\nsize=2\nstride=2\n",
    _conv(8, 3, 1), _conv(8, 3, 1, "linear"), "[shortcut]\nactivation=leaky\nfrom=-3\n",
    _conv(8, 3, 1), _conv(8, 3, 1, "linear"), "[shortcut]\nactivation=leaky\nfrom=-3\n",
    CLASSIFIER])
# yolov4-tiny's first CSP block: layers 0-8 (route groups=2 group_id=1 at 3, concat at 6 and 8),
# then max-pool 9, upsample 10, conv 11, a classifier at 12-13
CSP_BLOCK = HEAD + "\n".join([
    _conv(8, 3, 2), _conv(16, 3, 2), _conv(16, 3, 1), "[route]\nlayers=-1\ngroups=2\ngroup_id=1\n",
    _conv(8, 3, 1), _conv(8, 3, 1), "[route]\nlayers=-1,-2\n", _conv(16, 1, 1), "[route]\nlayers=-6,-1\n",
    "[maxpool]\nsize=2\nstride=2\n", "[upsample]\nstride=2\n", _conv(8, 3, 1),
    CLASSIFIER])
CFGS = {"resnet-front": RESNET_FRONT, "csp-block": CSP_BLOCK}


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cfg")
    paths = {}
    for name, text in CFGS.items():
        paths[name] = folder / f"{name}.cfg"
        paths[name].write_text(text)
    return lambda name: str(paths[name])


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _compare_stage(path: str, size: int, first: int, last: int, grid, grouping, input_delta: bool, batch: int = 2):
    net, desc, _ = build_model(path, size, classes=5, seed=1)
    net = net.double().train()
    stage = InProcessStage.build(net.layers[first:last], desc.layers[first:last], grid, grouping, input_delta)
    return _compare_built(net, desc, first, last, stage, input_delta, batch)


def _compare_built(net, desc, first: int, last: int, stage, input_delta: bool, batch: int = 2):
    """Two micro-batches through layers [first, last): untiled (the net's own forward_range and
    autograd, on a copy) and tiled (forward 0, forward 1, backward 1, backward 0, as 1F1B
    interleaves them); the worst relative difference over outputs, input deltas, gradients
    and buffers."""
    ref = copy.deepcopy(net)
    torch.manual_seed(0)
    c, h, w = desc.layers[first].in_shape
    oc, oh, ow = desc.layers[last - 1].out_shape
    xs = [torch.rand(batch, c, h, w, dtype=torch.float64) for _ in range(2)]
    dys = [torch.randn(batch, oc, oh, ow, dtype=torch.float64) for _ in range(2)]
    leaves = [x.clone().requires_grad_(input_delta) for x in xs]
    ys = [ref.forward_range(first, last, {first - 1: x})[last - 1] for x in leaves]
    sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
    outs = [stage.forward(m, x) for m, x in enumerate(xs)]
    dxs = {m: stage.backward(m, dys[m]) for m in (1, 0)}
    worst = [(rel_diff(o, y.detach()), f"output {m}") for m, (o, y) in enumerate(zip(outs, ys))]
    if input_delta:
        worst += [(rel_diff(dxs[m], leaves[m].grad), f"input delta {m}") for m in (0, 1)]
    else:
        assert dxs == {0: None, 1: None}
    # a gradient that is zero in exact arithmetic (a bias before BatchNorm) is pure rounding:
    # compare it against the stage's gradient scale
    pairs = [(name, p, q) for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters())
             if q.grad is not None]
    floor = 1e-4 * max([float(q.grad.norm()) for _, _, q in pairs] + [0.0])
    for name, p, q in pairs:
        worst.append((float((p.grad - q.grad).norm()) / max(float(q.grad.norm()), floor, 1e-300), f"grad {name}"))
    worst.append(_buffers_diff(net, ref))
    return max(worst)


def _buffers_diff(net, ref) -> tuple[float, str]:
    """Worst relative difference of the BatchNorm buffers; a running mean that is zero in exact
    arithmetic is measured against its channel's scale (as tests/test_tiles_exact.py does)."""
    a, b = net.state_dict(), ref.state_dict()
    worst = worst_state_diff({k: v for k, v in a.items() if not k.endswith("running_mean")},
                             {k: v for k, v in b.items() if not k.endswith("running_mean")})
    for k in (k for k in b if k.endswith("running_mean")):
        scale = float(b[k[:-len("mean")] + "var"].clamp(min=0).sqrt().norm())
        worst = max(worst, (float((a[k] - b[k]).norm()) / max(float(b[k].norm()), 1e-4 * scale, 1e-300), k))
    return worst


@pytest.mark.parametrize("name,first,last,input_delta,sync", [
    ("resnet-front", 0, 8, False, None),  # conv, pool, two residual blocks
    ("resnet-front", 2, 8, True, None),  # the blocks alone: the stage input is read twice, its delta is a sum
    ("resnet-front", 0, 8, False, "0,2,4,5,7"),  # conv and max-pool fused, and each block's two convolutions
    ("csp-block", 0, 9, False, None),  # the CSP block: a route of half the channels, two concats
    ("csp-block", 3, 12, True, None),  # from the split to the upsample and a conv behind it
    ("csp-block", 0, 12, False, "0,3,4,5,6,7,8,9"),  # conv 0-2 fused, and max-pool, upsample, conv fused
])
@pytest.mark.parametrize("size,grid", [(65, (2, 2)), (67, (1, 3)), (67, (3, 2))])
def test_a_stage_over_a_block_equals_untiled(cfg_path, name, first, last, input_delta, sync, size, grid):
    grouping = Grouping.every_layer(first, last) if sync is None else Grouping.parse(sync, first, last)
    worst = _compare_stage(cfg_path(name), size, first, last, grid, grouping, input_delta)
    assert worst[0] <= TOL, worst


def _cfg(path: str, size: int, microbatches: int = 2) -> TrainConfig:
    # warm-up off and a larger rate, so that the steps move the weights well beyond rounding
    return TrainConfig(model=path, img_size=size, batch_size=4, microbatches=microbatches, seed=3, classes=5,
                       warmup=0, lr=0.02, accelerator="cpu")


@pytest.mark.parametrize("name,size,grid", [("resnet-front", 65, (2, 2)), ("resnet-front", 67, (1, 3)),
                                            ("csp-block", 67, (2, 2)), ("csp-block", 65, (1, 3))])
def test_tiled_training_over_a_block_equals_local_after_sgd_steps(cfg_path, name, size, grid):
    """TiledTrainer tiles the network's longest tileable front (the blocks, up to the
    classifier's global pool) and trains three SGD steps of two micro-batches each."""
    path = cfg_path(name)
    desc = describe_model(path, size, classes=5)
    assert tileable_prefix(desc) == {"resnet-front": 8, "csp-block": 12}[name]
    local = train_float64(_cfg(path, size), 3)
    tiled = train_float64(_cfg(path, size), 3, grid)
    worst = worst_state_diff(tiled, local)
    assert worst[0] <= TOL, worst
    init, _, _ = build_model(path, size, classes=5, seed=3)
    moved = rel_diff(local["layers.0.conv.weight"], init.state_dict()["layers.0.conv.weight"].double())
    assert moved > 1e3 * max(worst[0], 1e-12)  # the steps changed the weights far beyond the difference
    assert int(tiled["layers.2.bn.num_batches_tracked"]) == 3 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("name,size,grid", [("resnet-front", 65, (2, 2)), ("csp-block", 67, (1, 3))])
def test_tiled_training_over_a_block_on_cuda_equals_local_on_the_cpu(cfg_path, name, size, grid):
    path = cfg_path(name)
    local = train_float64(_cfg(path, size), 3)
    on_cuda = dataclasses.replace(_cfg(path, size), accelerator="cuda")
    tiled = {k: v.cpu() for k, v in train_float64(on_cuda, 3, grid).items()}
    worst = worst_state_diff(tiled, local)
    assert worst[0] <= TOL, worst


def test_tiled_training_of_a_shorter_front_and_a_grouping_that_misses_a_graph_sync(cfg_path):
    path = cfg_path("csp-block")
    local = train_float64(_cfg(path, 65), 2)
    tiled = train_float64(_cfg(path, 65), 2, (2, 2), sync="0,3,4,5,6,7,8", last=9)
    worst = worst_state_diff(tiled, local)
    assert worst[0] <= TOL, worst
    with pytest.raises(SwarmError, match="add syncs at 3, 5 both ways"):
        train_float64(_cfg(path, 65), 1, (2, 2), sync="0,4,6,7,8", last=9)
    with pytest.raises(SwarmError, match="layer 2's map inside the stage is read after it by layer 8"):
        train_float64(_cfg(path, 65), 1, (2, 2), last=5)


# ---- random graphs (hypothesis) --------------------------------------------------------------------
BLOCKS = {
    "conv": lambda k, s: [_conv(4, k, s)],
    "residual": lambda k, s: [_conv(4, k, 1), _conv(4, 3, 1, "linear"), "[shortcut]\nactivation=leaky\nfrom=-3\n"],
    "csp": lambda k, s: ["[route]\nlayers=-1\ngroups=2\ngroup_id=1\n", _conv(4, k, 1), "[route]\nlayers=-1,-3\n",
                         _conv(4, 1, 1)],
    "maxpool": lambda k, s: [f"[maxpool]\nsize={k if k > 1 else 2}\nstride={s}\n"],
    "upsample": lambda k, s: ["[upsample]\nstride=2\n", _conv(4, k, 2)],
}


@st.composite
def graph_stacks(draw):
    kinds = draw(st.lists(st.sampled_from(sorted(BLOCKS)), min_size=1, max_size=4))
    body = [_conv(4, 3, 1)]  # 4 channels from here on, so that any block's add or route fits
    for kind in kinds:
        body += BLOCKS[kind](draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 2])))
    cfg = "[net]\nwidth=16\nheight=16\nchannels=3\n\n" + "\n".join(body) + "\n[softmax]\n"
    size = draw(st.integers(7, 29))
    try:
        net, desc, _ = build_model("graph.cfg", size, seed=draw(st.integers(0, 5)), cfg_text=cfg)
    except SwarmError:
        assume(False)
    n = len(desc.layers) - 1  # the softmax is no layer tiles take
    ranges = [(a, b) for a in range(n) for b in range(a + 1, n + 1) if stage_refusal(desc, a, b) is None]
    ranges.sort(key=lambda r: r[0] - r[1])  # the longer stages first: those hold the blocks
    first, last = draw(st.sampled_from(ranges[:max(1, len(ranges) // 3)]))
    need = set(required_syncs(desc.layers[first:last]))
    fwd = draw(st.sets(st.integers(first, last - 1))) | {b for b in need if b < last}
    bwd = draw(st.sets(st.integers(first + 1, last))) | need
    grid = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    return net.double().train(), desc, first, last, grid, Grouping.make(first, last, fwd, bwd)


def _check_graph(case, input_delta):
    net, desc, first, last, grid, grouping = case
    input_delta = input_delta or not any(d.params for d in desc.layers[first:last])  # something to differentiate
    try:
        stage = InProcessStage.build(net.layers[first:last], desc.layers[first:last], grid, grouping, input_delta)
    except TilingError as exc:
        assert "does not fit" in str(exc)
        assume(False)
    worst = _compare_built(net, desc, first, last, stage, input_delta)
    assert worst[0] <= TOL, (worst, [str(d) for d in desc.layers[first:last]], grid, grouping)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=graph_stacks(), input_delta=st.booleans())
def test_random_graph_stages_quick(case, input_delta):
    _check_graph(case, input_delta)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=graph_stacks(), input_delta=st.booleans())
def test_random_graph_stages(case, input_delta):
    _check_graph(case, input_delta)


# ---- which ranges one stage can take ---------------------------------------------------------
def test_the_tileable_front_of_darknets_residual_and_csp_networks():
    cfg = Path(__file__).resolve().parent / "cfg"
    resnet = next(cfg.rglob("resnet18.cfg"))
    desc = describe_model(str(resnet), 64, classes=5)
    # conv, max-pool, then where only one map is live: after each residual block; the block
    # at 8-10 adds a subsampled map (darknet's shortcut of two shapes), which tiles refuse
    assert tileable_ends(desc) == [1, 2, 5, 8]
    assert "adds maps of other shapes" in stage_refusal(desc, 8, 11)
    yolo = describe_model(str(next(cfg.rglob("yolov4-tiny.cfg"))), 64, classes=5)
    # after each CSP block and the max-pool and conv behind it, up to the third block's split
    # (layer 19), whose first half (layer 18's map) joins the block's end at layer 24
    assert tileable_ends(yolo) == [1, 2, 3, 9, 10, 11, 17, 18, 19]
    assert "layer 18's map inside the stage is read after it by layer 24" in stage_refusal(yolo, 0, 20)


@pytest.mark.parametrize("first,last,says", [
    (0, 3, "layer 1's map inside the stage is read after it by layer 4; a tiles stage passes on only its last map"),
    (0, 6, "layer 4's map inside the stage is read after it by layer 7"),
    (0, 9, "layer 8 (avgpool) pools the whole map"),
    (3, 8, "layer 4 reads layer 1's map from before the stage; a tiles stage takes in only the map before it"),
    (3, 4, "layer 1's map crosses the stage to layer 4"),
])
def test_a_stage_that_cannot_take_a_block_says_why_in_one_line(cfg_path, first, last, says):
    desc = describe_model(cfg_path("resnet-front"), 64, classes=5)
    reason = stage_refusal(desc, first, last)
    assert reason is not None and says in reason and "\n" not in reason


def _desc(layers: list[LayerDesc]) -> ModelDesc:
    return ModelDesc("hand", 16, 3, tuple(layers), "softmax")


def test_a_map_its_readers_would_cut_apart_is_refused():
    """Map 0 is read by a shortcut (cut where its output is) and by a 3x3 convolution padded
    on one side only (its cuts move one pixel): no ownership of map 0 suits both."""
    conv = dict(kernel=3, stride=1, batch_normalize=True, activation="leaky", flops=1000)
    layers = [LayerDesc(0, "conv", (3, 16, 16), (4, 16, 16), (-1,), padding=(1, 1, 1, 1), **conv),
              LayerDesc(1, "conv", (4, 16, 16), (4, 16, 16), (0,), padding=(0, 2, 0, 2), **conv),
              LayerDesc(2, "shortcut", (4, 16, 16), (4, 16, 16), (1, 0), flops=256)]
    reason = stage_refusal(_desc(layers), 0, 3)
    assert reason is not None and "cut one way for layer 2 and another for layer 1" in reason
    geoms = stage_geometries(layers)
    with pytest.raises(TilingError, match="one tiles stage cannot own it both ways"):
        build_layout(geoms, (2, 2), Grouping.every_layer(0, 3), input_delta=False)
    straight = [layers[0], LayerDesc(1, "conv", (4, 16, 16), (4, 16, 16), (0,), padding=(1, 1, 1, 1), **conv),
                layers[2]]
    assert stage_refusal(_desc(straight), 0, 3) is None
    assert required_syncs(straight) == (1, 2)  # map 0 is read twice, layer 2 adds


def test_graph_parts_sync_at_every_layer_and_chains_may_fuse(cfg_path):
    desc = describe_model(cfg_path("csp-block"), 64, classes=5)
    # 1, 2: conv into conv; 10, 11: max-pool into upsample into conv; the rest touch a route or a map read twice
    assert required_syncs(desc.layers[0:12]) == (3, 4, 5, 6, 7, 8, 9)
    res = describe_model(cfg_path("resnet-front"), 64, classes=5)
    assert required_syncs(res.layers[0:8]) == (2, 4, 5, 7)  # a block's two convolutions may fuse
    lay = build_layout(stage_geometries(res.layers[0:8]), (2, 2), Grouping.every_layer(0, 8), input_delta=False)
    assert not lay.is_chain and lay.readers[2] == [2, 4] and lay.readers[5] == [5, 7]
    for t in lay.tiles:  # shortcuts read and make their owned pixels: no halo at their maps
        assert t.own[2] == t.own[4] == t.own[5] and t.bwd_in[4] == t.own[5] and t.fwd_out[5] == t.own[5]
    assert 4 not in lay.forward_transfers and 5 not in lay.backward_transfers  # around the first shortcut
    assert lay.forward_transfers[5] and lay.backward_transfers[4]  # the convolutions' halos


def test_the_stage_modules_import_no_torch():
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = "import sys, tiles.stage_graph, tiles.layout; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_network_spec_needs_only_layers_and_live_maps():
    layers = [SimpleNamespace(index=0, kind="conv", inputs=(-1,), kernel=3, stride=1, padding=(1, 1, 1, 1),
                              in_shape=(3, 8, 8), out_shape=(4, 8, 8))]
    spec = SimpleNamespace(layers=layers, live_after=lambda b: (0,) if b == 1 else (-1,))
    assert tileable_ends(spec) == [1]


# ---- across devices ------------------------------------------------------------------------------
def _darknet(name: str) -> str:
    from tests.test_graph_plans import _model

    return _model(name)


@pytest.mark.parametrize("name,stages", [
    # resnet18: a 2x2 tiles stage over the conv, the max-pool and both residual blocks of 64
    # channels, then the blocks of 128 and the rest as a pipeline of two
    ("resnet18", [Stage(0, 8, "tiles", ["d0", "d1", "d2", "d3"], grid=(2, 2), tile_devices=["d0", "d1", "d2", "d3"]),
                  Stage(8, 21, "single", ["d1"]), Stage(21, 28, "single", ["d2"])]),
    # the blocks alone, between pipeline stages, two tiles on one device and each block's two
    # convolutions fused: the stage input is read by a convolution and a shortcut, and the
    # gradient it sends back is their sum
    ("resnet18", [Stage(0, 2, "single", ["d0"]),
                  Stage(2, 8, "tiles", ["d1", "d2"], grid=(1, 3), tile_devices=["d1", "d2", "d1"], syncs=[2, 4, 5, 7]),
                  Stage(8, 28, "single", ["d3"])]),
    # yolov4-tiny from its first CSP split (a route taking half the channels) through the
    # second block: the stage input is read by two routes, each taking other channels
    ("yolov4-tiny", [Stage(0, 3, "single", ["d0"]),
                     Stage(3, 17, "tiles", ["d1", "d2", "d3", "d0"], grid=(2, 2), tile_devices=["d1", "d2", "d3", "d0"]),
                     Stage(17, 38, "single", ["d3"])]),
])
def test_a_plan_with_a_tiles_stage_over_blocks_equals_local(name, stages):
    from tests.test_execution import _cfg as plan_cfg
    from tests.test_execution import _local, _planned, _worst

    cfg = plan_cfg(_darknet(name), 2, img_size=64)
    plan = Plan(cfg.model, 64, 8, 2, stages)
    plan.validate(describe_model(cfg.model, 64, classes=5))
    trainer = _planned(cfg, plan)
    worst, key = _worst(trainer.net.state_dict(), _local(cfg))
    assert worst < TOL, (key, worst)


# ---- what a graph stage costs, and the planner's stages ---------------------------------------------
def test_the_cost_model_counts_what_a_graph_stage_exchanges_computes_and_keeps(cfg_path):
    """Over resnet18's front at 65 on 2x2: the halo bytes each tile sends are those the executor
    sends, sync by sync (none at the shortcuts' maps); the shortcuts' FLOPs are counted once
    over the tiles (owned pixels only); what each tile keeps is what the model says."""
    from tiles.cost import stage_cost
    from tiles.driver import run_lockstep
    from tiles.executor import TileWorker
    from tiles.ops import crop
    from tiles.regions import Rect
    from tiles.requests import HaloExchange

    net, desc, _ = build_model(cfg_path("resnet-front"), 65, classes=5, seed=0)
    lay = build_layout(stage_geometries(desc.layers[0:8]), (2, 2), Grouping.every_layer(0, 8), input_delta=False)
    workers = [TileWorker(lay, k, list(net.layers[0:8]), keeps_running_stats=False) for k in range(lay.n_tiles)]
    sent: dict[tuple[str, int, int], int] = {}

    def recording(k, gen):
        answer = None
        while True:
            try:
                req = gen.send(answer)
            except StopIteration as stop:
                return stop.value
            if isinstance(req, HaloExchange):
                key = (req.phase, req.boundary, k)
                sent[key] = sent.get(key, 0) + sum(t.numel() * t.element_size() for _, _, t in req.sends)
            answer = yield req

    x = torch.rand(2, 3, 65, 65)
    outs = run_lockstep([recording(k, w.forward(0, crop(x, Rect.of(0, 65, 0, 65), lay.input_rect(k))))
                         for k, w in enumerate(workers)])
    cost = stage_cost(lay)
    stats = sum(g.out_channels * 4 for g in lay.layers if g.batch_norm)  # 1/std per BN layer
    for k, w in enumerate(workers):
        assert w.saved_bytes(0) == 2 * cost.tiles[k].saved_bytes + stats
    run_lockstep([recording(k, w.backward(0, torch.ones_like(o))) for k, (w, o) in enumerate(zip(workers, outs))])
    for k, t in enumerate(cost.tiles):
        for phase, table in (("forward", t.forward_send), ("backward", t.backward_send),
                             ("selection", t.selection_send)):
            per_sample = {b: n // 2 for (ph, b, kk), n in sent.items() if ph == phase and kk == k}
            assert per_sample == {b: n for b, n in table.items()}, (phase, k)
    forward = {b for ph, b, _ in sent if ph == "forward"}
    backward = {b for ph, b, _ in sent if ph == "backward"}
    assert not forward & {4, 7} and not backward & {5, 8}  # the shortcuts read and give back owned pixels
    assert 5 in forward and {4, 7} <= backward  # the convolutions around them trade halos
    for l in (4, 7):  # the shortcuts: on owned pixels, once
        assert sum(t.layer_forward_flops[l] for t in cost.tiles) == pytest.approx(desc.layers[l].flops)
    rounds = len(lay.forward_transfers) + len(lay.backward_transfers) + len(lay.selection_transfers)
    assert cost.comm_time(float("inf"), latency_s=1.0) == rounds + 2 * len(cost.bn_channels)


def test_the_grouping_choice_fuses_only_where_the_graph_allows(cfg_path):
    from tiles.cost import choose_grouping

    desc = describe_model(cfg_path("resnet-front"), 64, classes=5)
    for speed in (dict(flops_per_s=1e9, bytes_per_s=12.5e6, latency_s=1e-3, samples=4),
                  dict(flops_per_s=2e11, bytes_per_s=1.25e9, latency_s=5e-2, samples=1)):
        choice = choose_grouping(desc.layers[0:8], (2, 2), **speed)
        assert set(required_syncs(desc.layers[0:8])) <= set(choice.grouping.forward) & set(choice.grouping.backward)
    assert choice.grouping.forward == (0, 2, 4, 5, 7)  # costly syncs: everything the graph lets fuse is fused


@pytest.mark.parametrize("name,size,end", [("resnet18", 64, 8), ("yolov4-tiny", 128, 19), ("darknet53", 128, None)])
def test_the_tiles_planner_puts_blocks_in_a_tiles_stage_that_validates(name, size, end):
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel
    from planner.synthetic import flops_cluster
    from planner.tiles_planner import MAX_TILES_LAYERS, plan_tiles

    desc = describe_model(_darknet(name), size, classes=5)
    for mbps, latency_ms in ((100, 1.0), (10_000, 20.0)):
        cluster = flops_cluster(desc, {f"pi{i}": (4, "4 GiB") for i in range(4)}, mbps=mbps, latency_ms=latency_ms)
        inputs = PlanInputs(desc, MemoryModel.estimated(desc), cluster, 8, 2)
        plan = plan_tiles(inputs)
        stage = plan.stages[0]
        assert stage.mode == "tiles" and stage.last in tileable_ends(desc)
        assert stage.last == end if end is not None else stage.last <= MAX_TILES_LAYERS  # a deep network: its front
        assert any(d.kind in ("shortcut", "route") for d in desc.layers[:stage.last])
        plan.validate(desc)
        work = inputs.simulate(plan).works[0]
        assert work.detail["redundant_flops_per_sample"] >= 0 and max(work.detail["halo_bytes_per_sample"]) > 0


def test_a_plans_tiles_stage_without_its_graphs_syncs_is_refused_in_one_line():
    from planner.plan import PlanError

    desc = describe_model(_darknet("resnet18"), 64, classes=5)
    tiles = dict(grid=(2, 2), tile_devices=["d0", "d1", "d2", "d3"])
    plan = Plan(_darknet("resnet18"), 64, 8, 2, [Stage(0, 8, "tiles", ["d0", "d1", "d2", "d3"], syncs=[0, 2, 4, 7], **tiles),
                                                 Stage(8, 28, "single", ["d1"])])
    with pytest.raises(PlanError, match=r"stage 0 \(layers 0-7\): .*add syncs at 5 both ways") as err:
        plan.validate(desc)
    assert "\n" not in str(err.value)
    plan.stages[0].syncs = [0, 2, 4, 5, 7]
    plan.validate(desc)
    plan.stages = [Stage(0, 11, "tiles", ["d0", "d1", "d2", "d3"], **tiles), Stage(11, 28, "single", ["d1"])]
    with pytest.raises(PlanError, match=r"tiles cannot take these layers: layer 10 \(shortcut\) adds maps of other "
                                        "shapes") as err:
        plan.validate(desc)
    assert "\n" not in str(err.value)
