"""The region loss and the held-out metric."""
from __future__ import annotations

import math

import numpy as np
import torch

from swarm.local.evaluate import average_precision, mean_average_precision
from swarm.zoo import describe_model
from swarm.zoo.loss import RegionLoss, box_iou_cxcywh, nms

HEAD = describe_model("yolov2-16", 64, classes=3).extra


def _targets():
    t = torch.full((3, 2, 5), -1.0)
    t[0, 0] = torch.tensor([0, 0.5, 0.5, 0.3, 0.4])
    t[0, 1] = torch.tensor([2, 0.2, 0.8, 0.2, 0.2])
    t[1, 0] = torch.tensor([1, 0.7, 0.3, 0.6, 0.5])
    t[2, 0] = torch.tensor([1, 0.1, 0.1, 0.15, 0.1])
    return t


def test_region_loss_is_a_sum_over_samples():
    loss = RegionLoss(HEAD)
    torch.manual_seed(0)
    out = torch.randn(3, 5 * 8, 4, 4, requires_grad=True)
    t = _targets()
    whole = loss(out, t, batch_total=3)
    (g_whole,) = torch.autograd.grad(whole, out)
    parts = [loss(out[i:i + 1], t[i:i + 1], batch_total=3) for i in range(3)]
    g_parts = torch.autograd.grad(sum(parts), out)[0]
    assert torch.allclose(whole, sum(parts), rtol=1e-6)
    assert torch.allclose(g_whole, g_parts, rtol=1e-5, atol=1e-7)


def test_region_loss_prefers_the_truth():
    loss = RegionLoss(HEAD)
    t = _targets()[:1, :1]  # one box of class 0 at the centre
    perfect = torch.full((1, 5, 8, 4, 4), -10.0)
    cx, cy, w, h = 0.5, 0.5, 0.3, 0.4
    gx, gy = cx * 4, cy * 4
    i, j = int(gx), int(gy)
    anchors = torch.tensor(HEAD["anchors"])
    inter = torch.minimum(anchors[:, 0], torch.tensor(w * 4)) * torch.minimum(anchors[:, 1], torch.tensor(h * 4))
    a = int((inter / (anchors.prod(1) + w * h * 16 - inter)).argmax())
    frac = lambda v: math.log(v / (1 - v)) if 0 < v < 1 else 0.0  # noqa: E731
    perfect[0, a, :, j, i] = torch.tensor([frac(gx - i) if gx - i > 0 else -10.0, frac(gy - j) if gy - j > 0 else -10.0,
                                           math.log(w * 4 / anchors[a, 0]), math.log(h * 4 / anchors[a, 1]),
                                           10.0, 10.0, -10.0, -10.0])
    good = loss(perfect.view(1, 40, 4, 4), t, 1)
    bad = loss(torch.zeros(1, 40, 4, 4), t, 1)
    assert good < 0.05 < bad
    dets = loss.detections(perfect.view(1, 40, 4, 4))[0]
    assert dets[0, 0] == 0 and dets[0, 1] > 0.99
    assert torch.allclose(dets[0, 2:], torch.tensor([cx, cy, w, h]), atol=0.01)


def test_iou_and_nms():
    a = torch.tensor([[0.5, 0.5, 0.2, 0.2], [0.51, 0.5, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1]])
    iou = box_iou_cxcywh(a, a)
    assert torch.allclose(iou.diagonal(), torch.ones(3))
    assert iou[0, 2] == 0
    keep = nms(a, torch.tensor([0.9, 0.8, 0.7]), 0.45)
    assert keep.tolist() == [0, 2]


def test_average_precision_known_values():
    assert average_precision(np.array([0.9, 0.8]), np.array([True, True]), 2) == 1.0
    assert average_precision(np.array([0.9, 0.8]), np.array([False, True]), 2) == 0.25
    assert average_precision(np.array([0.9]), np.array([True]), 2) == 0.5


def test_map_perfect_and_wrong_class():
    truth = [np.array([[0, 0.5, 0.5, 0.2, 0.2], [1, 0.2, 0.2, 0.1, 0.1]], np.float32)]
    perfect = [np.array([[0, 0.9, 0.5, 0.5, 0.2, 0.2], [1, 0.8, 0.2, 0.2, 0.1, 0.1]], np.float32)]
    assert mean_average_precision(perfect, truth, 2)[0] == 1.0
    swapped = [np.array([[1, 0.9, 0.5, 0.5, 0.2, 0.2], [0, 0.8, 0.2, 0.2, 0.1, 0.1]], np.float32)]
    assert mean_average_precision(swapped, truth, 2)[0] == 0.0
    duplicate = [np.array([[0, 0.9, 0.5, 0.5, 0.2, 0.2], [0, 0.8, 0.5, 0.5, 0.2, 0.2]], np.float32)]
    value, per_class = mean_average_precision(duplicate, truth[:1], 2)
    assert per_class[0] == 1.0 and per_class[1] == 0.0  # a second hit on the same truth is a false positive


def test_region_loss_over_blocks_adds_up_to_the_whole_grid():
    head = dict(HEAD, rescore=True)
    loss = RegionLoss(head)
    torch.manual_seed(1)
    out = torch.randn(3, 40, 5, 7, requires_grad=True)
    t = _targets()
    whole = loss(out, t, 3)
    (g_whole,) = torch.autograd.grad(whole, out)
    total = 0
    for r0, r1 in [(0, 2), (2, 5)]:
        for c0, c1 in [(0, 3), (3, 4), (4, 7)]:
            total = total + loss(out[:, :, r0:r1, c0:c1], t, 3, window=(r0, c0, 5, 7))
    (g_blocks,) = torch.autograd.grad(total, out)
    assert torch.allclose(whole, total, rtol=1e-5)
    assert torch.allclose(g_whole, g_blocks, rtol=1e-5, atol=1e-7)


def test_coco_average_precision_reads_the_envelope_at_101_recalls():
    from swarm.local.evaluate import coco_average_precision

    assert coco_average_precision(np.array([0.9, 0.8]), np.array([True, True]), 2) == 1.0
    # a miss then a hit: precision 1/2 up to recall 1/2 (51 of the 101 points), then nothing
    assert abs(coco_average_precision(np.array([0.9, 0.8]), np.array([False, True]), 2) - 51 * 0.5 / 101) < 1e-12
    assert abs(coco_average_precision(np.array([0.9]), np.array([True]), 2) - 51 / 101) < 1e-12
    assert coco_average_precision(np.array([]), np.array([], dtype=bool), 2) == 0.0  # nothing found


def test_coco_map_over_iou_thresholds_and_its_greedy_matching():
    from swarm.local.evaluate import COCO_IOUS, coco_mean_average_precision

    truth = [np.array([[0, 0.5, 0.5, 0.4, 0.4]], dtype=np.float32)]
    # a box moved right by 0.06 of the image: 0.34 x 0.4 shared, IoU 0.136 / 0.184 = 0.739, a hit at 0.5 .. 0.7
    iou = 0.34 * 0.4 / (2 * 0.16 - 0.34 * 0.4)
    shifted = [np.array([[0, 0.9, 0.5, 0.56, 0.4, 0.4]], dtype=np.float32)]
    means, per_class = coco_mean_average_precision(shifted, truth, 2)
    assert np.isnan(per_class[1]).all()
    assert [round(v) for v in per_class[0]] == [1 if t <= iou else 0 for t in COCO_IOUS] == [1] * 5 + [0] * 5
    assert abs(means.mean() - 5 / 10) < 1e-12
    # a class with truths and no detection in any image counts as 0, one with neither is left out
    none = coco_mean_average_precision([np.zeros((0, 6), np.float32)], truth, 2)
    assert none[0][0] == 0.0 and (none[1][0] == 0).all() and np.isnan(none[1][1]).all()
    # two detections of one truth: the better scored takes it, the other is a false positive
    twice = [np.array([[0, 0.9, 0.5, 0.5, 0.4, 0.4], [0, 0.8, 0.5, 0.5, 0.4, 0.4]], dtype=np.float32)]
    assert coco_mean_average_precision(twice, truth, 1)[0][0] == 1.0
