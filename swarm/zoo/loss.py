"""Losses at the end of a network: YOLOv2's region loss and softmax cross-entropy here; YOLOv3's
(and later) yolo heads in yolo_loss.py, YOLOv1's detection layer in yolo1_loss.py.

Every loss here is a sum of per-sample terms divided by the size of the whole mini-batch,
so micro-batches, data-parallel shares and pipeline stages add up to the same gradient.
Every detecting loss has `detections(out, conf_thresh, nms_iou, max_det)`: per image, rows
(class, score, cx, cy, w, h) normalised to the input, after class-wise non-maximum suppression.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from planner.model_desc import ModelDesc
from swarm.zoo.boxes import MAX_CANDIDATES, box_iou_cxcywh, iou_loss, nms, select_detections
from swarm.zoo.yolo1_loss import DetectionLoss
from swarm.zoo.yolo_loss import YoloLoss

__all__ = ["RegionLoss", "SoftmaxLoss", "YoloLoss", "DetectionLoss", "LOSSES", "make_loss", "box_iou_cxcywh",
           "iou_loss", "nms", "select_detections", "MAX_CANDIDATES", "truth_at"]

class RegionLoss:
    """YOLOv2's region loss (Redmon & Farhadi 2017, darknet's region_layer).

    Each grid cell has `num` anchors; a prediction is (tx, ty, tw, th, to, class logits):
    centre = cell + sigmoid(t), size = anchor * exp(t), objectness = sigmoid(to). A ground
    truth box is assigned to the anchor of best shape in the cell holding its centre.
    Terms: coordinates (scaled by 2 - w*h), objectness towards 1 (or the IoU with
    `rescore`), objectness towards 0 for unassigned predictions that overlap no truth by
    more than `thresh`, and class cross-entropy.
    """

    def __init__(self, head: dict):
        self.classes = head["classes"]
        self.num = head["num"]
        self.anchors = torch.tensor(head["anchors"], dtype=torch.float32)  # (A, 2) in grid cells
        self.object_scale = head["object_scale"]
        self.noobject_scale = head["noobject_scale"]
        self.class_scale = head["class_scale"]
        self.coord_scale = head["coord_scale"]
        self.thresh = head["thresh"]
        self.rescore = head["rescore"]

    def split(self, out: torch.Tensor):
        """(B, A*(5+C), H, W) -> (B, A, H, W, 5+C)."""
        b, _, h, w = out.shape
        return out.view(b, self.num, 5 + self.classes, h, w).permute(0, 1, 3, 4, 2)

    def boxes(self, p: torch.Tensor, window: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """Predicted boxes (B, A, h, w, 4) as normalised (cx, cy, w, h). `window` (row0, col0,
        H, W) places this block of cells inside a full H x W grid (a tile of the output)."""
        _, _, h, w, _ = p.shape
        r0, c0, gh, gw = window if window is not None else (0, 0, h, w)
        ys = (r0 + torch.arange(h, dtype=p.dtype, device=p.device)).view(1, 1, h, 1)
        xs = (c0 + torch.arange(w, dtype=p.dtype, device=p.device)).view(1, 1, 1, w)
        aw = self.anchors[:, 0].view(1, -1, 1, 1).to(p.device, p.dtype)
        ah = self.anchors[:, 1].view(1, -1, 1, 1).to(p.device, p.dtype)
        cx = (xs + torch.sigmoid(p[..., 0])) / gw
        cy = (ys + torch.sigmoid(p[..., 1])) / gh
        bw = torch.exp(p[..., 2].clamp(max=10)) * aw / gw
        bh = torch.exp(p[..., 3].clamp(max=10)) * ah / gh
        return torch.stack([cx, cy, bw, bh], dim=-1)

    def __call__(self, out: torch.Tensor, targets: torch.Tensor, batch_total: int,
                 window: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """out: (B, A*(5+C), h, w); targets: (B, N, 5) rows (class, cx, cy, w, h), class < 0
        for padding; returns the summed loss of these samples divided by `batch_total`.

        With `window` (row0, col0, H, W) `out` is the block of cells [row0, row0+h) x
        [col0, col0+w) of a full H x W grid; the losses of the blocks of a grid add up to
        the loss of the whole grid, so tiles can each take theirs."""
        if out.shape[0] == 0:
            return out.sum() * 0.0
        p = self.split(out)
        bsz, na, bh_cells, bw_cells, _ = p.shape
        r0, c0, gh, gw = window if window is not None else (0, 0, bh_cells, bw_cells)
        with torch.no_grad():
            pred = self.boxes(p.detach(), (r0, c0, gh, gw))  # (B, A, h, w, 4)
            valid = targets[..., 0] >= 0  # (B, N)
            truth = targets[..., 1:5]
            if targets.shape[1] > 0:
                iou = box_iou_cxcywh(pred.view(bsz, -1, 4), truth)  # (B, A*H*W, N)
                iou = iou.masked_fill(~valid.unsqueeze(1), 0.0)
                best_iou = iou.max(dim=-1).values.view(bsz, na, bh_cells, bw_cells)
            else:
                best_iou = torch.zeros(bsz, na, bh_cells, bw_cells, dtype=p.dtype, device=p.device)
            assigned = torch.zeros(bsz, na, bh_cells, bw_cells, dtype=torch.bool, device=p.device)
            tbox = torch.zeros(bsz, na, bh_cells, bw_cells, 4, dtype=p.dtype, device=p.device)
            tcls = torch.zeros(bsz, na, bh_cells, bw_cells, dtype=torch.long, device=p.device)
            tscale = torch.zeros(bsz, na, bh_cells, bw_cells, dtype=p.dtype, device=p.device)
            anchors = self.anchors.to(p.device, p.dtype)
            bi, ni = valid.nonzero(as_tuple=True)
            if bi.numel():
                t = targets[bi, ni]  # (T, 5)
                gx = (t[:, 1] * gw).clamp(0, gw - 1e-4)
                gy = (t[:, 2] * gh).clamp(0, gh - 1e-4)
                tw_cells, th_cells = t[:, 3] * gw, t[:, 4] * gh
                # best anchor by shape: IoU of boxes sharing a centre
                inter = torch.minimum(tw_cells[:, None], anchors[None, :, 0]) * \
                    torch.minimum(th_cells[:, None], anchors[None, :, 1])
                union = tw_cells[:, None] * th_cells[:, None] + anchors.prod(-1)[None, :] - inter
                ai = (inter / union).argmax(dim=1)
                ci, cj = gx.long(), gy.long()
                # Two truths on the same (cell, anchor): the later one wins, as in darknet.
                flat = ((bi * na + ai) * gh + cj) * gw + ci
                order = torch.arange(flat.numel(), device=p.device)
                last = torch.zeros(bsz * na * gh * gw, dtype=torch.long, device=p.device).scatter_reduce(
                    0, flat, order, reduce="amax", include_self=False)
                keep = last[flat] == order
                # ... and only truths whose cell lies in this block are this block's to learn
                keep &= (cj >= r0) & (cj < r0 + bh_cells) & (ci >= c0) & (ci < c0 + bw_cells)
                bi, ai, cj, ci, t = bi[keep], ai[keep], cj[keep], ci[keep], t[keep]
                gx, gy, tw_cells, th_cells = gx[keep], gy[keep], tw_cells[keep], th_cells[keep]
                gx, gy, cj, ci = gx - c0, gy - r0, cj - r0, ci - c0  # block-local cells
                assigned[bi, ai, cj, ci] = True
                tbox[bi, ai, cj, ci] = torch.stack([
                    gx - ci, gy - cj,
                    torch.log(tw_cells.clamp(min=1e-6) / anchors[ai, 0]),
                    torch.log(th_cells.clamp(min=1e-6) / anchors[ai, 1])], dim=-1)
                tcls[bi, ai, cj, ci] = t[:, 0].long()
                tscale[bi, ai, cj, ci] = 2.0 - t[:, 3] * t[:, 4]
            noobj = (~assigned) & (best_iou <= self.thresh)
            if self.rescore:
                obj_target = box_iou_cxcywh(pred[assigned].unsqueeze(-2),
                                            truth_at(assigned, tbox, anchors, (r0, c0, gh, gw)).unsqueeze(-2)).view(-1)
            else:
                obj_target = torch.ones(int(assigned.sum()), dtype=p.dtype, device=p.device)

        obj = torch.sigmoid(p[..., 4])
        loss = self.noobject_scale * (obj[noobj] ** 2).sum()
        loss = loss + self.object_scale * ((obj[assigned] - obj_target) ** 2).sum()
        pa = p[assigned]  # (T, 5+C)
        xy = torch.sigmoid(pa[:, :2])
        coord = ((xy - tbox[assigned][:, :2]) ** 2).sum(-1) + ((pa[:, 2:4] - tbox[assigned][:, 2:]) ** 2).sum(-1)
        loss = loss + self.coord_scale * (tscale[assigned] * coord).sum()
        if pa.shape[0]:
            loss = loss + self.class_scale * F.cross_entropy(pa[:, 5:], tcls[assigned], reduction="sum")
        return loss / batch_total

    @torch.no_grad()
    def detections(self, out: torch.Tensor, conf_thresh: float = 0.005, nms_iou: float = 0.45,
                   max_det: int = 100) -> list[torch.Tensor]:
        """Per image, rows (class, score, cx, cy, w, h) after per-class non-maximum suppression."""
        p = self.split(out)
        boxes = self.boxes(p).flatten(1, 3)  # (B, A*H*W, 4)
        obj = torch.sigmoid(p[..., 4]).flatten(1)  # (B, A*H*W)
        probs = torch.softmax(p[..., 5:], dim=-1).flatten(1, 3)  # (B, A*H*W, C)
        return select_detections(boxes, obj.unsqueeze(-1) * probs, conf_thresh, nms_iou, max_det)

def truth_at(assigned: torch.Tensor, tbox: torch.Tensor, anchors: torch.Tensor, window) -> torch.Tensor:
    """Normalised (cx, cy, w, h) of the truths at the assigned positions (for rescoring)."""
    r0, c0, gh, gw = window
    b, a, j, i = assigned.nonzero(as_tuple=True)
    t = tbox[assigned]
    return torch.stack([(c0 + i + t[:, 0]) / gw, (r0 + j + t[:, 1]) / gh,
                        torch.exp(t[:, 2]) * anchors[a, 0] / gw, torch.exp(t[:, 3]) * anchors[a, 1] / gh], dim=-1)

class SoftmaxLoss:
    """Cross-entropy for classifiers; the target is one class per sample."""

    def __init__(self, head: dict):
        self.classes = head["classes"]

    def __call__(self, out: torch.Tensor, targets: torch.Tensor, batch_total: int) -> torch.Tensor:
        return F.cross_entropy(out.flatten(1), targets, reduction="sum") / batch_total

LOSSES = {"region": RegionLoss, "yolo": YoloLoss, "detection": DetectionLoss}  # the detecting ones, by desc.loss


def make_loss(desc: ModelDesc):
    """The loss a network's description names (softmax cross-entropy for a classifier)."""
    return LOSSES.get(desc.loss, SoftmaxLoss)(desc.extra)
