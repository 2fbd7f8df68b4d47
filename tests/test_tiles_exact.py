"""Tiled == untiled: gradients, outputs, input deltas and BN statistics, then weights after real SGD steps.

Comparisons run in float64, where reordering noise is ~1e-13, so the 1e-5 bound tests the
algorithm, not rounding (float32 runs of these BN networks differ by up to ~5e-3 in some
tensors between two *local* runs that merely use different thread counts).
"""
from __future__ import annotations

import copy
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.image_size import ImageSize
from swarm.errors import SwarmError
from swarm.local.trainer import TrainConfig
from swarm.zoo import build_model
from tests.tiles_reference import rel_diff, train_float64, worst_state_diff
from tiles import ops
from tiles.grouping import Grouping
from tiles.regions import TilingError
from tiles.whole_stage import InProcessStage

TOL = 1e-5  # the bound (float64 results agree to ~1e-12)


def _compare_stage(net, desc, first, last, grid, grouping, input_delta, batch=2, seed=0):
    """Two micro-batches through layers [first, last) untiled (autograd) and tiled (forward 0,
    forward 1, backward 1, backward 0, as 1F1B interleaves them); returns the worst relative
    difference over outputs, input deltas, parameter gradients and BN buffers."""
    torch.manual_seed(seed)
    ref = copy.deepcopy(net)
    c, h, w = desc.layers[first].in_shape
    oc, oh, ow = desc.layers[last - 1].out_shape
    xs = [torch.rand(batch, c, h, w, dtype=torch.float64) for _ in range(2)]
    dys = [torch.randn(batch, oc, oh, ow, dtype=torch.float64) for _ in range(2)]
    ref_ys, total = [], 0
    leaves = [x.clone().requires_grad_(input_delta) for x in xs]
    for x in leaves:
        y = x
        for layer in ref.layers[first:last]:
            y = layer(y)
        ref_ys.append(y)
    for y, dy in zip(ref_ys, dys):
        total = total + (y * dy).sum()
    total.backward()
    stage = InProcessStage.build(net.layers[first:last], desc.layers[first:last], grid, grouping, input_delta)
    ys = [stage.forward(m, x) for m, x in enumerate(xs)]
    dxs = {m: stage.backward(m, dys[m]) for m in (1, 0)}
    worst = [(rel_diff(y, r.detach()), f"output {m}") for m, (y, r) in enumerate(zip(ys, ref_ys))]
    if input_delta:
        worst += [(rel_diff(dxs[m], leaves[m].grad), f"input delta {m}") for m in (0, 1)]
    else:
        assert dxs == {0: None, 1: None}
    pairs = list(zip(net.layers[first:last].named_parameters(), ref.layers[first:last].named_parameters()))
    # a gradient that is zero in exact arithmetic (a bias before BatchNorm whose activation is
    # linear on all its pixels) is pure rounding: compare it against the stage's gradient scale
    floor = 1e-4 * max([float(q.grad.norm()) for _, (_, q) in pairs] + [0.0])
    for (name, p), (_, q) in pairs:
        worst.append((float((p.grad - q.grad).norm()) / max(float(q.grad.norm()), floor, 1e-300), f"grad {name}"))
    worst.append(_buffers_diff(net, ref))
    return max(worst)


def _buffers_diff(net, ref) -> tuple[float, str]:
    """Worst relative difference of the BatchNorm buffers. A running mean that is zero in
    exact arithmetic (a BatchNorm fed by a zero-mean map, e.g. a linear BatchNorm layer's
    output through a bias-free 1x1 conv, at the initial gamma 1 and beta 0) is pure rounding
    (~1e-17): it is measured against its channel's scale, sqrt(running_var), as gradients are
    against theirs."""
    a, b = net.state_dict(), ref.state_dict()
    worst = worst_state_diff({k: v for k, v in a.items() if not k.endswith("running_mean")},
                             {k: v for k, v in b.items() if not k.endswith("running_mean")})
    for k in (k for k in b if k.endswith("running_mean")):
        scale = float(b[k[:-len("mean")] + "var"].clamp(min=0).sqrt().norm())
        worst = max(worst, (float((a[k] - b[k]).norm()) / max(float(b[k].norm()), 1e-4 * scale, 1e-300), k))
    return worst


@lru_cache(maxsize=None)
def _yolo16(size):
    net, desc, _ = build_model("yolov2-16", size, classes=5, seed=1)
    return net.double().train(), desc


GROUPINGS = {"every": lambda: Grouping.every_layer(0, 17), "one": lambda: Grouping.one_group(0, 17),
             "mixed": lambda: Grouping.parse("0,3,9,12", 0, 17),
             "unmirrored": lambda: Grouping.make(0, 17, [0, 5, 8], [2, 8, 11, 17])}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("size,grid,grouping", [
    (48, (1, 2), "every"), (48, (2, 2), "one"), (64, (2, 3), "mixed"), (48, (3, 3), "unmirrored"),
    (ImageSize(80, 32), (2, 3), "mixed"),  # maps 32x80 down to 2x5: 3 uneven columns, 2 rows
    pytest.param(80, (4, 4), "every", marks=pytest.mark.slow), pytest.param(80, (2, 3), "one", marks=pytest.mark.slow),
    pytest.param(112, (3, 3), "mixed", marks=pytest.mark.slow),
])
def test_yolov2_16_one_microbatch_pair(size, grid, grouping):
    net, desc = _yolo16(size)
    net = copy.deepcopy(net)
    worst = _compare_stage(net, desc, 0, 17, grid, GROUPINGS[grouping](), input_delta=False)
    assert worst[0] <= TOL, worst


def test_middle_stage_produces_exact_input_deltas():
    net, desc = _yolo16(64)
    net = copy.deepcopy(net)
    worst = _compare_stage(net, desc, 2, 14, (2, 3), Grouping.parse("2,5,9", 2, 14), input_delta=True)
    assert worst[0] <= TOL, worst


def _compare_block(net, desc, first, last, grid, grouping, splits, input_delta, seed=0):
    """Micro-batches of `splits` samples: untiled one after another (autograd), and tiled as
    one block with per-micro-batch BatchNorm statistics. Worst relative difference."""
    torch.manual_seed(seed)
    ref = copy.deepcopy(net)
    c, h, w = desc.layers[first].in_shape
    oc, oh, ow = desc.layers[last - 1].out_shape
    xs = [torch.rand(n, c, h, w, dtype=torch.float64) for n in splits]
    dys = [torch.randn(n, oc, oh, ow, dtype=torch.float64) for n in splits]
    leaves = [x.clone().requires_grad_(input_delta) for x in xs]
    ref_ys = []
    for x, dy in zip(leaves, dys):  # as the local trainer runs micro-batches
        y = x
        for layer in ref.layers[first:last]:
            y = layer(y)
        (y * dy).sum().backward()
        ref_ys.append(y.detach())
    stage = InProcessStage.build(net.layers[first:last], desc.layers[first:last], grid, grouping, input_delta)
    y = stage.forward(0, torch.cat(xs), splits)
    dx = stage.backward(0, torch.cat(dys))
    worst = [(rel_diff(y, torch.cat(ref_ys)), "output")]
    if input_delta:
        worst.append((rel_diff(dx, torch.cat([x.grad for x in leaves])), "input delta"))
    for (name, p), (_, q) in zip(net.layers[first:last].named_parameters(), ref.layers[first:last].named_parameters()):
        worst.append((rel_diff(p.grad, q.grad), f"grad {name}"))
    worst.append(_buffers_diff(net, ref))
    return max(worst)


@pytest.mark.parametrize("grid,grouping,splits", [((2, 2), "every", (2, 2, 2)), ((1, 3), "mixed", (2, 1, 2)),
                                                  ((2, 2), "one", (3,))])
def test_a_block_of_microbatches_equals_them_one_by_one(grid, grouping, splits):
    """Several micro-batches through a tiles stage at once (one exchange per sync for all):
    outputs, gradients and BN running statistics (updated once per micro-batch, in order)
    are those of the micro-batches run one after another."""
    net, desc = _yolo16(48)
    worst = _compare_block(copy.deepcopy(net), desc, 0, 17, grid, GROUPINGS[grouping](), splits, input_delta=False)
    assert worst[0] <= TOL, worst
    worst = _compare_block(copy.deepcopy(net), desc, 2, 14, grid, Grouping.parse("2,5,9", 2, 14), splits,
                           input_delta=True)
    assert worst[0] <= TOL, worst


def test_a_block_must_add_up():
    net, desc = _yolo16(48)
    stage = InProcessStage.build(net.layers[0:17], desc.layers[0:17], (2, 2), Grouping.every_layer(0, 17), False)
    with pytest.raises(TilingError, match="do not make up"):
        stage.forward(0, torch.rand(4, 3, 48, 48, dtype=torch.float64), (2, 1))


# ---- random stacks (hypothesis) ----------------------------------------------------------------
def _conv(filters, size, stride, pad, bn, act):
    return (f"[convolutional]\nbatch_normalize={int(bn)}\nfilters={filters}\nsize={size}\nstride={stride}\n"
            f"pad={int(pad)}\nactivation={act}\n")


layer_sections = st.one_of(
    st.builds(_conv, st.integers(2, 5), st.sampled_from([1, 3, 5]), st.sampled_from([1, 2]), st.booleans(),
              st.booleans(), st.sampled_from(["leaky", "linear", "relu", "logistic", "tanh"])),
    st.builds(lambda s, t: f"[maxpool]\nsize={s}\nstride={t}\n", st.sampled_from([2, 3]), st.sampled_from([1, 2])),
    st.just("[avgpool]\nsize=2\nstride=2\n"),
)


@st.composite
def stacks(draw):
    body = draw(st.lists(layer_sections, min_size=1, max_size=5))
    body = [_conv(draw(st.integers(2, 4)), 3, 1, True, True, "leaky")] + body  # a stage starts with weights
    cfg = "[net]\nwidth=16\nheight=16\nchannels=3\n\n" + "\n".join(body) + "\n[softmax]\n"
    size = draw(st.integers(7, 33))
    try:
        net, desc, _ = build_model("stack.cfg", size, seed=draw(st.integers(0, 5)), cfg_text=cfg)
    except SwarmError:
        assume(False)
    n = len(desc.layers)
    first = draw(st.integers(0, n - 1))
    last = draw(st.integers(first + 1, n))
    fwd = draw(st.sets(st.integers(first, last - 1)))
    bwd = draw(st.one_of(st.none(), st.sets(st.integers(first + 1, last))))
    grid = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    return net.double().train(), desc, first, last, grid, Grouping.make(first, last, fwd, bwd)


def _check_stack(case, input_delta):
    net, desc, first, last, grid, grouping = case
    input_delta = input_delta or not any(d.params for d in desc.layers[first:last])  # something to differentiate
    try:
        worst = _compare_stage(net, desc, first, last, grid, grouping, input_delta, batch=2)
    except TilingError as exc:
        assert "does not fit" in str(exc)
        assume(False)
    assert worst[0] <= 1e-9, (worst, [str(d) for d in desc.layers[first:last]], grid, grouping)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=stacks(), input_delta=st.booleans())
def test_random_stacks_quick(case, input_delta):
    _check_stack(case, input_delta)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=stacks(), input_delta=st.booleans())
def test_random_stacks(case, input_delta):
    _check_stack(case, input_delta)


def test_batchnorm_after_a_max_pool_of_a_one_pixel_map():
    """A shape the random stacks found: conv, avg-pool, conv to 1x1, a 2x2 max-pool of stride
    1 (padded with -inf to fit), a ReLU 1x1 conv, and a BatchNorm 1x1 conv whose input is
    zero in both samples. Its channel is constant, so torch's kernel reports 1/sqrt(var) as
    0; the running variance must come out 0.81 as untiled, not inf."""
    body = [_conv(2, 3, 1, True, True, "leaky"), "[avgpool]\nsize=2\nstride=2\n", _conv(2, 3, 1, False, False, "leaky"),
            "[maxpool]\nsize=2\nstride=1\n", _conv(2, 1, 1, False, False, "relu"), _conv(2, 1, 1, True, True, "leaky")]
    cfg = "[net]\nwidth=16\nheight=16\nchannels=3\n\n" + "\n".join(body) + "\n[softmax]\n"
    net, desc, _ = build_model("stack.cfg", 7, seed=2, cfg_text=cfg)
    worst = _compare_stage(net.double().train(), desc, 0, 6, (1, 1), Grouping(0, 6, (0,), (6,)), False)
    assert worst[0] <= 1e-9, worst


@pytest.mark.parametrize("value", [0.0, 0.37, -2.5])
def test_forward_sums_of_a_constant_channel(value):
    z = torch.full((2, 1, 3, 3), value, dtype=torch.float64)
    want = torch.tensor([[18 * value], [18 * value * value]], dtype=torch.float64)
    assert torch.allclose(ops.forward_sums(z), want, rtol=1e-12, atol=0)


# ---- whole training steps ---------------------------------------------------------------------
def _cfg(size, batch, microbatches=1):
    # warm-up off and a larger rate, so that three steps move the weights well beyond rounding
    return TrainConfig(model="yolov2-16", img_size=size, batch_size=batch, microbatches=microbatches, seed=1,
                       classes=5, warmup=0, lr=0.01)


@lru_cache(maxsize=None)
def _local(size, batch, microbatches):
    return train_float64(_cfg(size, batch, microbatches), 3)


def _assert_tiled_equals_local(size, batch, microbatches, grid, sync):
    local = _local(size, batch, microbatches)
    tiled = train_float64(_cfg(size, batch, microbatches), 3, grid, sync)
    worst = worst_state_diff(tiled, local)
    assert worst[0] <= TOL, worst
    init, _, _ = build_model("yolov2-16", size, classes=5, seed=1)
    moved = rel_diff(local["layers.0.conv.weight"], init.state_dict()["layers.0.conv.weight"].double())
    assert moved > 1e3 * max(worst[0], 1e-12)  # the steps changed the weights far beyond the difference
    assert int(tiled["layers.0.bn.num_batches_tracked"]) == 3 * microbatches


def test_three_sgd_steps_small():
    _assert_tiled_equals_local(48, 4, 2, (2, 2), "0,4,8")


def test_three_sgd_steps_on_a_rectangular_map():
    """A 64x32 input (maps 32x64 down to 2x4, a 2x4 grid of cells) in a 2x3 grid of tiles."""
    _assert_tiled_equals_local(ImageSize(64, 32), 4, 2, (2, 3), "0,4,8")


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(1, 2), (2, 2), (2, 3), (3, 3), (4, 4)])
@pytest.mark.parametrize("sync", ["all", "none", "0,3,7,12"])
def test_three_sgd_steps_grids_and_groupings(grid, sync):
    _assert_tiled_equals_local(80, 2, 1, grid, sync)  # 80: maps 80, 40, 20, 10, 5 -- uneven for 2x3, 3x3, 4x4


@pytest.mark.slow
@pytest.mark.parametrize("grid,sync", [((2, 2), "0,4,8,12"), ((4, 4), "all")])
def test_three_sgd_steps_at_416(grid, sync):
    _assert_tiled_equals_local(416, 2, 1, grid, sync)


@pytest.mark.slow
def test_untileable_tail_runs_untiled_in_the_same_process():
    cfg = lambda: TrainConfig(model="yolov2", img_size=64, batch_size=2, seed=1, classes=5, warmup=0, lr=0.01)  # noqa: E731
    local = train_float64(cfg(), 2)
    tiled = train_float64(cfg(), 2, (2, 2), "0,8")
    worst = worst_state_diff(tiled, local)
    assert worst[0] <= TOL, worst


@pytest.mark.parametrize("body", [
    [("conv", 3, "leaky"), ("conv", 1, "linear"), ("conv", 1, "leaky")],
    [("conv", 3, "leaky"), ("conv", 1, "leaky"), ("conv", 1, "linear"), ("avgpool",), ("conv", 1, "leaky")],
])
def test_zero_running_mean_is_compared_at_its_scale(body):
    """Shapes the random stacks found: a BatchNorm whose running mean is zero in exact
    arithmetic. Outputs, gradients and buffers must agree, the mean at its channel's scale."""
    sections = [_conv(2, b[1], 1, True, True, b[2]) if b[0] == "conv" else "[avgpool]\nsize=2\nstride=2\n" for b in body]
    cfg = "[net]\nwidth=16\nheight=16\nchannels=3\n\n" + "\n".join(sections) + "\n[softmax]\n"
    net, desc, _ = build_model("stack.cfg", 8, seed=0, cfg_text=cfg)
    n = len(desc.layers)
    worst = _compare_stage(net.double().train(), desc, 0, n, (1, 1), Grouping(0, n, (0,), (n,)), False)
    assert worst[0] <= 1e-9, worst
