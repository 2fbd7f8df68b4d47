"""The yolo heads' loss (YOLOv3 and later) and YOLOv1's detection loss: sums over samples,
darknet's assignment of truths to anchors and heads, the box decodings, NMS across heads,
and a small network that learns with them."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from planner.model_desc import ModelDesc
from swarm.data.shapes import SyntheticShapes
from swarm.local.detect import Detector
from swarm.local.evaluate import evaluate
from swarm.zoo.loss import DetectionLoss, RegionLoss, SoftmaxLoss, YoloLoss, iou_loss, make_loss

W, H = 64, 48  # the input in pixels; not square, so that widths and heights cannot be swapped unnoticed
ANCHORS = [(6, 8), (12, 14), (20, 24), (30, 36), (44, 40), (60, 46)]
C = 3
GRIDS = [(3, 4), (6, 8)]  # (h, w) of head 0 (large anchors) and head 1 (small anchors)


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are small: one thread computes them fastest, and leaves the other core be."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def yolo_head(mask, **options) -> dict:
    head = {"layer": 0, "grid": None, "anchors": ANCHORS, "mask": mask, "ignore_thresh": 0.5, "truth_thresh": 1.0,
            "iou_thresh": 1.0, "scale_x_y": 1.0, "iou_loss": "mse", "iou_normalizer": 0.75, "cls_normalizer": 1.0,
            "obj_normalizer": 1.0, "max_delta": math.inf, "new_coords": False, "label_smooth_eps": 0.0,
            "objectness_smooth": False}
    head.update(options)
    return head


def yolo_extra(classes: int = C, **options) -> dict:
    heads = [dict(yolo_head([3, 4, 5], **options), layer=10, grid=GRIDS[0]),
             dict(yolo_head([0, 1, 2], **options), layer=20, grid=GRIDS[1])]
    return {"loss": "yolo", "classes": classes, "img_wh": (W, H), "heads": heads}


def yolo(classes: int = C, **options) -> YoloLoss:
    return YoloLoss(yolo_extra(classes, **options))


def random_outs(b: int, seed: int = 0, dtype=torch.float64, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(b, 3 * (5 + C), h, w, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
            for h, w in GRIDS]


def targets(dtype=torch.float64) -> torch.Tensor:
    """Four samples: two boxes, one box, none, three boxes (two of them in the same cell)."""
    t = torch.full((4, 3, 5), -1.0, dtype=torch.float64)
    t[0, 0] = torch.tensor([0, 0.53, 0.45, 0.5, 0.7])
    t[0, 1] = torch.tensor([2, 0.2, 0.8, 0.1, 0.15])
    t[1, 0] = torch.tensor([1, 0.7, 0.3, 0.9, 0.8])
    t[3, 0] = torch.tensor([1, 0.1, 0.1, 0.15, 0.1])
    t[3, 1] = torch.tensor([0, 0.12, 0.11, 0.17, 0.2])
    t[3, 2] = torch.tensor([2, 0.9, 0.6, 0.6, 0.3])
    return t.to(dtype)


def slot(outs: list[torch.Tensor], k: int) -> torch.Tensor:
    """Head k's output as (B, A, 5+C, h, w): anchor-major channels, as darknet lays them out."""
    b, _, h, w = outs[k].shape
    return outs[k].view(b, 3, 5 + C, h, w)


def best_anchor(w: float, h: float) -> int:
    tw, th = w * W, h * H
    ious = [min(tw, aw) * min(th, ah) / (tw * th + aw * ah - min(tw, aw) * min(th, ah)) for aw, ah in ANCHORS]
    return int(np.argmax(ious))


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def perfect_outs(t: torch.Tensor, s: float = 1.0) -> list[torch.Tensor]:
    """Raw outputs that predict exactly the truths of `t` (one image) with certainty."""
    outs = [torch.zeros(1, 3 * (5 + C), h, w, dtype=torch.float64) for h, w in GRIDS]
    for k in range(2):
        slot(outs, k)[:, :, 4] = -12.0
    for cls, cx, cy, w, h in t[t[:, 0] >= 0].tolist():
        n = best_anchor(w, h)
        k, a = (0, n - 3) if n >= 3 else (1, n)
        gh, gw = GRIDS[k]
        i, j = int(cx * gw), int(cy * gh)
        raw = slot(outs, k)[0, a, :, j, i]
        raw[0] = logit((cx * gw - i + (s - 1) / 2) / s)
        raw[1] = logit((cy * gh - j + (s - 1) / 2) / s)
        raw[2] = math.log(w * W / ANCHORS[n][0])
        raw[3] = math.log(h * H / ANCHORS[n][1])
        raw[4] = 12.0
        raw[5:] = -12.0
        raw[5 + int(cls)] = 12.0
    return [o.requires_grad_() for o in outs]


VARIANTS = [
    {},
    {"iou_loss": "giou", "max_delta": 0.3, "scale_x_y": 1.1},
    {"iou_loss": "ciou", "iou_thresh": 0.2, "truth_thresh": 0.6, "ignore_thresh": 0.3},
    {"iou_loss": "diou", "objectness_smooth": True, "label_smooth_eps": 0.1, "obj_normalizer": 2.0},
    {"new_coords": True, "scale_x_y": 2.0, "iou_thresh": 0.3},
    {"new_coords": True, "scale_x_y": 2.0, "iou_loss": "ciou", "max_delta": 0.2},
]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_the_loss_of_a_batch_is_the_sum_of_its_sample_ranges(options):
    loss = yolo(**options)
    scale = 0.2 if options.get("new_coords") else 1.0  # new_coords heads read probabilities-sized values
    outs = random_outs(4, seed=3, scale=scale)
    if options.get("new_coords"):
        outs = [torch.sigmoid(o).detach().requires_grad_() for o in outs]
    t = targets()
    whole = loss(outs, t, batch_total=4)
    g_whole = torch.autograd.grad(whole, outs)
    parts = [loss([o[a:b] for o in outs], t[a:b], batch_total=4) for a, b in [(0, 1), (1, 3), (3, 4)]]
    g_parts = torch.autograd.grad(sum(parts), outs)
    assert whole.dtype == torch.float64 and whole.item() > 0
    assert abs(whole.item() - sum(parts).item()) <= 1e-12 * whole.item()
    for gw, gp in zip(g_whole, g_parts):
        assert torch.allclose(gw, gp, rtol=1e-12, atol=1e-15)
        assert gw.abs().sum() > 0


def test_an_empty_batch_is_zero_with_a_gradient_path():
    outs = random_outs(0)
    value = yolo()(outs, torch.zeros(0, 3, 5, dtype=torch.float64), 4)
    assert value.item() == 0.0 and value.requires_grad
    value.backward()
    assert all(o.grad is not None for o in outs)


def test_the_truth_costs_less_than_a_guess_and_detections_find_it():
    t = targets()[0]
    loss = yolo()
    perfect = perfect_outs(t)
    good = loss(perfect, t[None], 1)
    bad = loss(random_outs(1, seed=5), t[None], 1)
    assert good.item() < 0.05 < 1.0 < bad.item()
    found = loss.detections([o.detach() for o in perfect], conf_thresh=0.5)[0]
    assert found.shape == (2, 6)
    found = found[found[:, 0].argsort()]
    truth = t[t[:, 0] >= 0]
    truth = truth[truth[:, 0].argsort()]
    assert found[:, 0].tolist() == truth[:, 0].tolist() and (found[:, 1] > 0.99).all()
    assert torch.allclose(found[:, 2:], truth[:, 1:], atol=1e-4)
    # a step of gradient descent from a guess lowers the loss
    guess = random_outs(1, seed=5)
    grads = torch.autograd.grad(loss(guess, t[None], 1), guess)
    after = loss([g - 0.05 * d for g, d in zip(guess, grads)], t[None], 1)
    assert after < bad


def test_every_head_gets_a_gradient_where_its_truths_are():
    t = targets()[:1]  # a box for each head: anchor 3 (head 0) and anchor 0 (head 1)
    assert [best_anchor(*t[0, 0, 3:].tolist()), best_anchor(*t[0, 1, 3:].tolist())] == [3, 0]
    outs = random_outs(1)
    grads = torch.autograd.grad(yolo()(outs, t, 1), outs)
    for k, (cx, cy) in [(0, (0.53, 0.45)), (1, (0.2, 0.8))]:
        gh, gw = GRIDS[k]
        g = grads[k].view(1, 3, 5 + C, gh, gw)
        box = g[0, :, :4, int(cy * gh), int(cx * gw)].abs().sum(-1)
        assert (box > 0).sum() == 1  # the one anchor of the mask that learns the box
        assert g[0, :, 4].abs().sum() > 0  # objectness everywhere


def one_truth():
    """One truth box, its best anchor n, the head k and mask slot a that learn it, that head's
    grid and the truth's cell (i, j)."""
    cx, cy, w, h = 0.3, 0.7, 0.4, 0.6
    t = torch.tensor([[[1, cx, cy, w, h]]], dtype=torch.float64)
    n = best_anchor(w, h)
    k, a = (0, n - 3) if n >= 3 else (1, n)
    gh, gw = GRIDS[k]
    return t, n, k, a, (gh, gw), (int(cx * gw), int(cy * gh))


def test_the_gradients_at_a_truths_slot_are_darknets_deltas():
    """d loss / d output = -delta of darknet's forward_yolo_layer, at the slot that learns a truth:
    box (2 - w h) iou_normalizer (decoded - target), objectness obj_normalizer (p - 1), classes
    cls_normalizer (p - y) with y smoothed by label_smooth_eps. darknet's backward_yolo_layer
    copies its deltas to the layer below, so the centre's delta is taken by the logit as it is."""
    t, n, k, a, (gh, gw), (i, j) = one_truth()
    cls, cx, cy, w, h = t[0, 0].tolist()
    outs = random_outs(1, seed=11)
    loss = yolo(iou_normalizer=0.6, obj_normalizer=1.5, cls_normalizer=0.7, label_smooth_eps=0.2)
    grads = torch.autograd.grad(loss(outs, t, 1), outs)
    raw = slot(outs, k)[0, a, :, j, i].detach()
    g = grads[k].view(1, 3, 5 + C, gh, gw)[0, a, :, j, i]
    sig = torch.sigmoid(raw)
    scale = (2 - w * h) * 0.6
    target = [cx * gw - i, cy * gh - j, math.log(w * W / ANCHORS[n][0]), math.log(h * H / ANCHORS[n][1])]
    assert g[0].item() == pytest.approx(scale * (sig[0] - target[0]).item())  # no logistic derivative
    assert g[1].item() == pytest.approx(scale * (sig[1] - target[1]).item())
    assert g[2].item() == pytest.approx(scale * (raw[2] - target[2]).item())
    assert g[3].item() == pytest.approx(scale * (raw[3] - target[3]).item())
    assert g[4].item() == pytest.approx(1.5 * (sig[4] - 1).item())
    y = torch.full((C,), 0.1, dtype=torch.float64)
    y[int(cls)] = 0.9
    assert g[5:].tolist() == pytest.approx((0.7 * (sig[5:] - y)).tolist())


@pytest.mark.parametrize("kind,new_coords", [("ciou", False), ("giou", False), ("ciou", True)])
def test_the_gradients_of_an_iou_loss_are_darknets_deltas(kind, new_coords):
    """darknet's delta_yolo_box for an IoU loss: the IoU's derivatives by the decoded box
    (cx, cy, w, h relative to the image), times iou_normalizer, the sizes' times exp(tw) (as
    they are with new_coords), handed to the outputs unchanged (no logistic, no 1/grid)."""
    t, n, k, a, (gh, gw), (i, j) = one_truth()
    cls, cx, cy, w, h = t[0, 0].tolist()
    outs = random_outs(1, seed=5, scale=0.5)
    if new_coords:
        outs = [torch.sigmoid(o).detach().requires_grad_() for o in outs]
    loss = yolo(iou_loss=kind, iou_normalizer=0.07, new_coords=new_coords, scale_x_y=1.05)
    grads = torch.autograd.grad(loss(outs, t, 1), outs)
    raw = slot(outs, k)[0, a, :, j, i].detach()
    g = grads[k].view(1, 3, 5 + C, gh, gw)[0, a, :4, j, i]
    # the decoded box by hand, as a leaf, and the IoU loss's derivatives by it
    s = 1.05
    xy = raw[:2] if new_coords else torch.sigmoid(raw[:2])
    centre = [(xy[0] * s - (s - 1) / 2 + i) / gw, (xy[1] * s - (s - 1) / 2 + j) / gh]
    size = (2 * raw[2:4]) ** 2 if new_coords else torch.exp(raw[2:4])
    box = torch.stack([*centre, size[0] * ANCHORS[n][0] / W, size[1] * ANCHORS[n][1] / H]).requires_grad_()
    (d,) = torch.autograd.grad(iou_loss(box[None], t[0, :, 1:], kind).sum(), box)
    want = 0.07 * d * torch.cat([torch.ones(2, dtype=d.dtype), torch.ones(2, dtype=d.dtype) if new_coords else size])
    assert g.tolist() == pytest.approx(want.tolist(), rel=1e-9, abs=1e-15)


def test_a_truth_is_learnt_only_by_the_head_whose_mask_holds_its_best_anchor():
    small = torch.tensor([[[2, 0.4, 0.6, 12 / W, 14 / H]]], dtype=torch.float64)  # anchor 1 exactly: head 1, slot 1
    outs = random_outs(1, seed=7)
    grads = torch.autograd.grad(yolo()(outs, small, 1), outs)
    g0, g1 = grads[0].view(1, 3, 5 + C, *GRIDS[0]), grads[1].view(1, 3, 5 + C, *GRIDS[1])
    assert g0[:, :, :4].abs().sum() == 0 and g0[:, :, 5:].abs().sum() == 0  # no box, no class terms
    assert g0[:, :, 4].abs().sum() > 0  # only objectness towards 0
    i, j = int(0.4 * GRIDS[1][1]), int(0.6 * GRIDS[1][0])
    assert g1[0, 1, :4, j, i].abs().min() > 0 and g1[0, 1, 5:, j, i].abs().min() > 0
    learnt = g1[:, :, :4].abs().sum(2) > 0
    assert learnt.sum() == 1 and learnt[0, 1, j, i]
    # with iou_thresh, a head-0 anchor close enough in shape learns it too
    near = torch.tensor([[[2, 0.4, 0.6, 24 / W, 30 / H]]], dtype=torch.float64)  # best: anchor 2 (head 1)
    assert best_anchor(24 / W, 30 / H) == 2
    for thresh, head0_learns in [(1.0, False), (0.55, True)]:
        g0 = torch.autograd.grad(yolo(iou_thresh=thresh)(outs, near, 1), outs)[0].view(1, 3, 5 + C, *GRIDS[0])
        assert bool(g0[:, 0, :4].abs().sum() > 0) == head0_learns  # anchor 3 = slot 0 of head 0
        assert g0[:, 1:, :4].abs().sum() == 0


def test_predictions_already_on_a_truth_are_not_pushed_to_zero_objectness():
    t = targets()[0]
    outs = perfect_outs(t)
    # another anchor slot of head 0 at the first truth's cell predicts the same box, with no objectness
    cx, cy, w, h = t[0, 1:].tolist()
    assert best_anchor(w, h) == 3  # head 0, slot 0
    gh, gw = GRIDS[0]
    i, j = int(cx * gw), int(cy * gh)
    with torch.no_grad():
        raw = slot(outs, 0)[0, 2, :, j, i]  # anchor 5, not the truth's best
        raw[:2] = slot(outs, 0)[0, 0, :2, j, i]
        raw[2], raw[3] = math.log(w * W / ANCHORS[5][0]), math.log(h * H / ANCHORS[5][1])
        raw[4] = 0.0
    for ignore, pushed in [(0.5, False), (1.0, True)]:
        g = torch.autograd.grad(yolo(ignore_thresh=ignore)(outs, t[None], 1), outs)[0]
        assert bool(g.view(1, 3, 5 + C, gh, gw)[0, 2, 4, j, i] > 0.1) == pushed


@pytest.mark.parametrize("kind", ["mse", "iou", "giou", "diou", "ciou"])
@pytest.mark.parametrize("new_coords", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_box_loss_is_finite_for_degenerate_boxes(kind, new_coords, dtype):
    t = torch.tensor([[[0, 0.5, 0.5, 0.0, 0.3], [1, 1.0, 0.0, 0.2, 0.0], [2, 0.0, 1.0, 0.0, 0.0],
                       [0, 0.3, 0.3, 1.0, 1.0]]], dtype=dtype)
    loss = yolo(iou_loss=kind, new_coords=new_coords, max_delta=5.0 if kind == "ciou" else math.inf,
                iou_thresh=0.5, scale_x_y=2.0 if new_coords else 1.0)
    for fill in [0.0, 1e3, -1e3]:
        outs = [torch.full((1, 3 * (5 + C), h, w), fill, dtype=dtype, requires_grad=True) for h, w in GRIDS]
        value = loss(outs, t, 1)
        grads = torch.autograd.grad(value, outs)
        assert torch.isfinite(value), (fill, value)
        assert all(torch.isfinite(g).all() for g in grads), fill
        assert any(g.abs().sum() > 0 for g in grads)


def test_iou_losses_know_their_values():
    a = torch.tensor([[0.5, 0.5, 0.2, 0.2]], dtype=torch.float64)
    same = iou_loss(a, a, "giou"), iou_loss(a, a, "diou"), iou_loss(a, a, "ciou")
    assert all(abs(v.item()) < 1e-6 for v in same)
    b = torch.tensor([[0.8, 0.5, 0.2, 0.2]], dtype=torch.float64)  # 0.1 apart, side by side
    assert iou_loss(a, b, "iou").item() == pytest.approx(1.0)
    assert iou_loss(a, b, "giou").item() == pytest.approx(1 + (0.5 * 0.2 - 0.08) / (0.5 * 0.2))
    assert iou_loss(a, b, "diou").item() == pytest.approx(1 + 0.09 / (0.5 ** 2 + 0.2 ** 2))
    wide = torch.tensor([[0.5, 0.5, 0.4, 0.1]], dtype=torch.float64)  # same centre, same area, other shape
    assert iou_loss(a, wide, "ciou").item() > iou_loss(a, wide, "diou").item() > 0


def test_new_coords_and_scale_x_y_decode_as_darknet_does():
    s, col, row, a = 2.0, 2, 1, 1  # head 0, slot 1 = anchor 4
    raw = [0.3, 0.9, 0.6, 0.2]
    out = torch.zeros(1, 3 * (5 + C), *GRIDS[0], dtype=torch.float64)
    out.view(1, 3, 5 + C, *GRIDS[0])[0, a, :4, row, col] = torch.tensor(raw, dtype=torch.float64)
    gh, gw = GRIDS[0]
    loss = yolo(new_coords=True, scale_x_y=s)
    box = loss.boxes(loss.split(out, 0), 0)[0, a, row, col]
    hand = [(raw[0] * 2 - 0.5 + col) / gw, (raw[1] * 2 - 0.5 + row) / gh,
            (2 * raw[2]) ** 2 * ANCHORS[4][0] / W, (2 * raw[3]) ** 2 * ANCHORS[4][1] / H]
    assert box.tolist() == pytest.approx(hand, abs=1e-12)
    s = 1.2
    loss = yolo(scale_x_y=s)
    box = loss.boxes(loss.split(out, 0), 0)[0, a, row, col]
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    hand = [(sig(raw[0]) * s - (s - 1) / 2 + col) / gw, (sig(raw[1]) * s - (s - 1) / 2 + row) / gh,
            math.exp(raw[2]) * ANCHORS[4][0] / W, math.exp(raw[3]) * ANCHORS[4][1] / H]
    assert box.tolist() == pytest.approx(hand, abs=1e-12)


@pytest.mark.parametrize("new_coords,s", [(False, 1.0), (False, 1.2), (True, 2.0)])
def test_the_mse_target_is_the_decoded_truth(new_coords, s):
    """Outputs that decode exactly to the truth get no box gradient: the mse targets and the
    decoding agree, with scale_x_y and with new_coords."""
    t = targets()[0]
    outs = perfect_outs(t, s)
    if new_coords:
        with torch.no_grad():
            for k in range(2):
                p = slot(outs, k)
                p[:, :, :2] = (torch.sigmoid(p[:, :, :2]) * s - (s - 1) / 2 + 0.5) / 2
                p[:, :, 2:4] = torch.sqrt(torch.exp(p[:, :, 2:4]) / 4)
                p[:, :, 4:] = torch.sigmoid(p[:, :, 4:])
    loss = yolo(new_coords=new_coords, scale_x_y=s)
    grads = torch.autograd.grad(loss(outs, t[None], 1), outs)
    assert sum(g.view(1, 3, 5 + C, *g.shape[2:])[:, :, :4].abs().sum() for g in grads) < 1e-12
    found = loss.detections([o.detach() for o in outs], conf_thresh=0.5)[0]
    assert len(found) == 2
    truth = t[t[:, 0] >= 0]
    assert torch.allclose(found[found[:, 0].argsort(), 2:], truth[truth[:, 0].argsort(), 1:], atol=1e-4)


def test_detections_pool_the_heads_and_one_nms_removes_a_box_both_found():
    outs = [torch.zeros(1, 3 * (5 + C), h, w, dtype=torch.float64) for h, w in GRIDS]
    for k in range(2):
        slot(outs, k)[:, :, 4] = -12.0
        slot(outs, k)[:, :, 5:] = -12.0
    # the same box (centre (0.4, 0.45), 30 x 36 px) from head 0 (anchor 3) and head 1 (anchor 2),
    # and a second box only head 1 finds
    same = [(0, 0, 1, 1, 0.3), (1, 2, 3, 2, 0.2)]  # head, slot, col, row, objectness
    for k, a, i, j, obj in same:
        gh, gw = GRIDS[k]
        n = 3 + a if k == 0 else a
        raw = slot(outs, k)[0, a, :, j, i]
        raw[0], raw[1] = logit(0.4 * gw - i), logit(0.45 * gh - j)
        raw[2], raw[3] = math.log(30 / ANCHORS[n][0]), math.log(36 / ANCHORS[n][1])
        raw[4], raw[6] = logit(obj), 12.0
    other = slot(outs, 1)[0, 0, :, 5, 7]
    other[0], other[1], other[2], other[3], other[4], other[5] = 0.0, 0.0, 0.0, 0.0, 12.0, 12.0
    (found,) = yolo().detections(outs, conf_thresh=0.1)
    assert found.shape == (2, 6)
    assert found[:, 0].tolist() == [0, 1]  # best first: the second box, then the shared one
    assert found[1, 1].item() == pytest.approx(0.3, abs=1e-4)  # the better of the two copies
    assert found[1, 2:].tolist() == pytest.approx([0.4, 0.45, 30 / W, 36 / H], abs=1e-6)
    (alone,) = yolo().detections(outs, conf_thresh=0.1, nms_iou=1.0)
    assert len(alone) == 3
    # one head's output alone (a tensor, not a list) is the same as a one-element list
    one = YoloLoss({"loss": "yolo", "classes": C, "img_wh": (W, H), "heads": [yolo_head([3, 4, 5])]})
    assert torch.equal(one.detections(outs[0], 0.1)[0], one.detections([outs[0]], 0.1)[0])


class TwoHeads(nn.Module):
    """A tiny conv net with a 6x8 head (small anchors) under a 3x4 head (large ones), W x H input."""

    def __init__(self, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.LeakyReLU(0.1), nn.Conv2d(16, 16, 3, 2, 1),
                                  nn.LeakyReLU(0.1), nn.Conv2d(16, 16, 3, 2, 1), nn.LeakyReLU(0.1))  # (16, 6, 8)
        self.down = nn.Sequential(nn.Conv2d(16, 16, 3, 2, 1), nn.LeakyReLU(0.1))  # (16, 3, 4)
        self.fine = nn.Conv2d(16, 3 * (5 + classes), 1)
        self.coarse = nn.Conv2d(16, 3 * (5 + classes), 1)

    def forward(self, x):
        if x.dtype == torch.uint8:
            x = x.to(self.fine.weight.dtype) / 255
        y = self.stem(x)
        return [self.coarse(self.down(y)), self.fine(y)]


def truth_slots(outs: list[torch.Tensor], t: torch.Tensor, k: int) -> torch.Tensor:
    """Objectness logits of the slots (head, anchor, cell) that learn image k's truths."""
    found = []
    for _, cx, cy, w, h in t[k][t[k, :, 0] >= 0].tolist():
        n = best_anchor(w, h)
        head, a = (0, n - 3) if n >= 3 else (1, n)
        gh, gw = GRIDS[head]
        found.append(outs[head][k].view(3, -1, gh, gw)[a, 4, int(cy * gh), int(cx * gw)])
    return torch.stack(found)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_small_two_head_network_learns_two_images(seed):
    torch.manual_seed(seed)
    data = SyntheticShapes("train", (W, H), 3)
    images, boxes = zip(*(data.load(k) for k in range(2)))
    x = torch.from_numpy(np.stack(images))
    t = torch.full((2, max(len(b) for b in boxes), 5), -1.0, dtype=torch.float64)
    for k, b in enumerate(boxes):
        t[k, :len(b)] = torch.from_numpy(b).double()
    net = TwoHeads(len(data.classes)).double()
    loss = yolo(len(data.classes), iou_loss="ciou", iou_normalizer=0.5)
    opt = torch.optim.SGD(net.parameters(), lr=0.003, momentum=0.9)
    history = []
    for _ in range(60):
        opt.zero_grad()
        value = loss(net(x), t, 2)
        value.backward()
        opt.step()
        history.append(value.item())
    assert all(math.isfinite(v) for v in history)
    assert history[-1] < 0.15 * history[0], history[::10]
    # not only "nothing anywhere": the slots that hold the truths score above the rest
    with torch.no_grad():
        outs = net(x)
    for k in range(2):
        everything = torch.cat([o[k].view(3, 5 + len(data.classes), -1)[:, 4].flatten() for o in outs])
        assert truth_slots(outs, t, k).mean() > everything.mean() + 1.0


def test_evaluate_and_detect_take_a_network_with_several_heads():
    torch.manual_seed(1)
    desc = ModelDesc("two-heads", (W, H), 3, (), "yolo", yolo_extra(classes=5))
    result = evaluate(TwoHeads(5), desc, SyntheticShapes("heldout", (W, H), 3, size=6), batch_size=4)
    assert result.metric == "mAP@0.5" and 0.0 <= result.value <= 1.0 and result.samples == 6
    assert len(result.per_class) == 5
    detector = Detector.__new__(Detector)  # what a checkpoint would give, without one
    detector.desc, detector.loss = desc, make_loss(desc)
    assert detector.is_detector and detector.num_classes == 5


def test_make_loss_picks_the_loss_the_description_names():
    region = {"loss": "region", "classes": 2, "num": 1, "anchors": [(1.0, 1.0)], "object_scale": 5.0,
              "noobject_scale": 1.0, "class_scale": 1.0, "coord_scale": 1.0, "thresh": 0.6, "rescore": False}
    yolo_extra = {"loss": "yolo", "classes": C, "img_wh": (W, H), "heads": [yolo_head([0, 1, 2])]}
    for name, extra, kind in [("region", region, RegionLoss), ("yolo", yolo_extra, YoloLoss),
                              ("detection", DETECTION, DetectionLoss), ("softmax", {"classes": 4}, SoftmaxLoss)]:
        desc = ModelDesc("m", 32, 3, (), name, extra)
        assert type(make_loss(desc)) is kind
        assert desc.detects == (kind is not SoftmaxLoss)


# YOLOv1: side 3, two boxes a cell, three classes
DETECTION = {"loss": "detection", "classes": C, "side": 3, "num": 2, "coords": 4, "sqrt": True, "rescore": False,
             "softmax": False, "object_scale": 1.0, "noobject_scale": 0.5, "class_scale": 1.0, "coord_scale": 5.0}
CELLS = 9
SIZE = CELLS * (C + 2 * 5)


@pytest.mark.parametrize("options", [{}, {"rescore": True, "softmax": True, "sqrt": False}])
def test_detection_loss_is_a_sum_over_sample_ranges(options):
    loss = DetectionLoss(dict(DETECTION, **options))
    torch.manual_seed(2)
    out = torch.rand(4, SIZE, dtype=torch.float64, requires_grad=True)
    t = targets()
    whole = loss(out, t, 4)
    (g_whole,) = torch.autograd.grad(whole, out)
    parts = [loss(out[a:b], t[a:b], 4) for a, b in [(0, 2), (2, 3), (3, 4)]]
    (g_parts,) = torch.autograd.grad(sum(parts), out)
    assert abs(whole.item() - sum(parts).item()) <= 1e-12 * whole.item()
    assert torch.allclose(g_whole, g_parts, rtol=1e-12, atol=1e-15)
    empty = loss(out[:0], t[:0], 4)
    assert empty.item() == 0.0 and empty.requires_grad


def test_two_truths_in_one_cell_the_last_listed_is_learnt():
    loss = DetectionLoss(DETECTION)
    out = torch.zeros(1, SIZE, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[[0, 0.5, 0.5, 0.2, 0.2], [2, 0.45, 0.55, 0.3, 0.1], [-1, 0, 0, 0, 0]]], dtype=torch.float64)
    for order, learnt in [([0, 1, 2], 2), ([1, 0, 2], 0)]:
        (g,) = torch.autograd.grad(loss(out, t[:, order], 1), out)
        classes = g[0, :CELLS * C].view(CELLS, C)
        assert classes[4, learnt] < 0 and (classes[4, [c for c in range(C) if c != learnt]] == 0).all()
        assert classes[[c for c in range(CELLS) if c != 4]].abs().sum() == 0


def detection_perfect(t: torch.Tensor) -> torch.Tensor:
    """A YOLOv1 output (1, SIZE) giving box 0 of each truth's cell exactly, sure of its class."""
    out = torch.zeros(1, SIZE, dtype=torch.float64)
    cls = out[0, :CELLS * C].view(CELLS, C)
    conf = out[0, CELLS * C:CELLS * (C + 2)].view(CELLS, 2)
    box = out[0, CELLS * (C + 2):].view(CELLS, 2, 4)
    box[:, 1] = torch.tensor([0.5, 0.5, 0.05, 0.05])  # the other box: small, unsure
    for c, cx, cy, w, h in t[t[:, 0] >= 0].tolist():
        col, row = int(cx * 3), int(cy * 3)
        cell = row * 3 + col
        cls[cell, int(c)] = 1.0
        conf[cell, 0] = 1.0
        box[cell, 0] = torch.tensor([cx * 3 - col, cy * 3 - row, math.sqrt(w), math.sqrt(h)], dtype=torch.float64)
    return out


def test_detection_loss_prefers_the_truth_and_its_detections_find_it():
    t = targets()[:1]
    loss = DetectionLoss(DETECTION)
    perfect = detection_perfect(t[0])
    assert loss(perfect, t, 1).item() < 1e-12
    assert loss(torch.rand(1, SIZE, dtype=torch.float64), t, 1).item() > 0.5
    (found,) = loss.detections(perfect, conf_thresh=0.5)
    found = found[found[:, 0].argsort()]
    truth = t[0, t[0, :, 0] >= 0]
    truth = truth[truth[:, 0].argsort()]
    assert found[:, 0].tolist() == truth[:, 0].tolist()
    assert found[:, 1].tolist() == pytest.approx([1.0, 1.0])
    assert torch.allclose(found[:, 2:], truth[:, 1:], atol=1e-9)
    # the responsible box is the one that overlaps the truth best
    out = perfect.clone()
    box_1 = torch.tensor([0.5, 0.5, math.sqrt(0.1), math.sqrt(0.1)], dtype=torch.float64)
    out[0, CELLS * (C + 2):].view(CELLS, 2, 4)[4, 1] = box_1
    out.requires_grad_()
    (g,) = torch.autograd.grad(loss(out, t, 1), out)
    assert g.abs().sum() < 1e-12  # box 0 still fits the truth of cell 4 better
    moved = t.clone()
    moved[0, 0, 1:] = torch.tensor([0.5, 0.5, 0.1, 0.1], dtype=torch.float64)  # box 1 of cell 4, exactly
    (g,) = torch.autograd.grad(loss(out, moved, 1), out)
    conf = g[0, CELLS * C:CELLS * (C + 2)].view(CELLS, 2)
    assert conf[4, 0] > 0 > conf[4, 1]  # box 0 now towards no object, box 1 towards one
    assert g[0, CELLS * (C + 2):].view(CELLS, 2, 4)[4].abs().sum() < 1e-12  # box 1 is exact; box 0 has no box term
