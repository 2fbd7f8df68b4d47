"""Boxes as the detecting losses see them: IoU of (cx, cy, w, h) boxes, the box losses of
darknet's iou_loss=, non-maximum suppression and the choice of detections."""
from __future__ import annotations

import math

import torch


def box_iou_cxcywh(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU between boxes a (..., N, 4) and b (..., M, 4) given as (cx, cy, w, h) -> (..., N, M)."""
    a1, a2 = a[..., :2] - a[..., 2:] / 2, a[..., :2] + a[..., 2:] / 2
    b1, b2 = b[..., :2] - b[..., 2:] / 2, b[..., :2] + b[..., 2:] / 2
    lo = torch.maximum(a1.unsqueeze(-2), b1.unsqueeze(-3))
    hi = torch.minimum(a2.unsqueeze(-2), b2.unsqueeze(-3))
    inter = (hi - lo).clamp(min=0).prod(-1)
    area_a = a[..., 2:].prod(-1).unsqueeze(-1)
    area_b = b[..., 2:].prod(-1).unsqueeze(-2)
    return inter / (area_a + area_b - inter).clamp(min=1e-12)

def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_thresh: float) -> torch.Tensor:
    """Greedy non-maximum suppression; returns indices kept, best first."""
    order = scores.argsort(descending=True)
    boxes = boxes[order]
    iou = box_iou_cxcywh(boxes, boxes)
    keep = torch.ones(len(order), dtype=torch.bool, device=boxes.device)
    for k in range(len(order)):
        if keep[k]:
            keep[k + 1:] &= iou[k, k + 1:] <= iou_thresh
    return order[keep]


# (box, class) pairs per image that go into NMS for the yolo and detection heads, the best: an
# untrained network's tens of thousands would otherwise make evaluation quadratic in them
MAX_CANDIDATES = 2000


def select_detections(boxes: torch.Tensor, scores: torch.Tensor, conf_thresh: float, nms_iou: float,
                      max_det: int, max_candidates: int | None = None) -> list[torch.Tensor]:
    """boxes (B, P, 4) normalised (cx, cy, w, h), scores (B, P, C) -> per image rows (class,
    score, cx, cy, w, h), best first: the (box, class) pairs above `conf_thresh` (at most
    `max_candidates` of them, the best), greedy NMS within each class, the best `max_det`."""
    result = []
    for b in range(boxes.shape[0]):
        rows = []
        idx, cls = (scores[b] > conf_thresh).nonzero(as_tuple=True)
        if max_candidates is not None and idx.numel() > max_candidates:
            best = scores[b, idx, cls].topk(max_candidates).indices
            idx, cls = idx[best], cls[best]
        for c in cls.unique():
            sel = idx[cls == c]
            keep = nms(boxes[b, sel], scores[b, sel, c], nms_iou)
            sel = sel[keep]
            rows.append(torch.cat([torch.full((sel.numel(), 1), float(c), device=boxes.device),
                                   scores[b, sel, c].unsqueeze(1),
                                   boxes[b, sel]], dim=1))
        det = torch.cat(rows) if rows else torch.zeros(0, 6, device=boxes.device)
        det = det[det[:, 1].argsort(descending=True)[:max_det]]
        result.append(det)
    return result


def iou_loss(pred: torch.Tensor, truth: torch.Tensor, kind: str, eps: float = 1e-9) -> torch.Tensor:
    """1 - IoU, GIoU, DIoU or CIoU of box pairs pred, truth (T, 4) given as (cx, cy, w, h) -> (T,).
    Degenerate boxes (zero width or height) give finite values and gradients."""
    p1, p2 = pred[:, :2] - pred[:, 2:] / 2, pred[:, :2] + pred[:, 2:] / 2
    t1, t2 = truth[:, :2] - truth[:, 2:] / 2, truth[:, :2] + truth[:, 2:] / 2
    inter = (torch.minimum(p2, t2) - torch.maximum(p1, t1)).clamp(min=0).prod(-1)
    union = pred[:, 2] * pred[:, 3] + truth[:, 2] * truth[:, 3] - inter
    iou = inter / (union + eps)
    if kind == "iou":
        return 1 - iou
    outer = torch.maximum(p2, t2) - torch.minimum(p1, t1)  # (T, 2) the smallest box holding both
    if kind == "giou":
        hull = outer.prod(-1)
        return 1 - (iou - (hull - union) / (hull + eps))
    rho2 = ((pred[:, :2] - truth[:, :2]) ** 2).sum(-1)  # squared distance of the centres
    diou = iou - rho2 / ((outer ** 2).sum(-1) + eps)
    if kind == "diou":
        return 1 - diou
    if kind != "ciou":
        raise ValueError(f"iou_loss {kind!r} is not one of mse, iou, giou, diou, ciou")
    v = (4 / math.pi ** 2) * (torch.atan(truth[:, 2] / (truth[:, 3] + eps)) -
                              torch.atan(pred[:, 2] / (pred[:, 3] + eps))) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return 1 - (diou - alpha * v)
