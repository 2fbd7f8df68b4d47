"""Losses at the end of a network: YOLOv2's region loss, YOLOv3's (and later) yolo heads,
YOLOv1's detection layer, and softmax cross-entropy.

Every loss here is a sum of per-sample terms divided by the size of the whole mini-batch,
so micro-batches, data-parallel shares and pipeline stages add up to the same gradient.
Every detecting loss has `detections(out, conf_thresh, nms_iou, max_det)`: per image, rows
(class, score, cx, cy, w, h) normalised to the input, after class-wise non-maximum suppression.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planner.model_desc import ModelDesc


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


class _ClipGrad(torch.autograd.Function):
    """Identity forward; the gradient clipped to [-bound, bound] elementwise (darknet's max_delta)."""

    @staticmethod
    def forward(ctx, x, bound):
        ctx.bound = bound
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clamp(-ctx.bound, ctx.bound), None


class YoloLoss:
    """The loss of darknet's [yolo] heads (YOLOv3 and later; src/yolo_layer.c), over all of a
    network's heads at once.

    Each head predicts, per cell and per anchor of its `mask`, (tx, ty, tw, th, to, C class
    scores). Centre = (sigmoid(t) * s - (s - 1) / 2 + cell) / grid with s = scale_x_y, size =
    anchor * exp(t) / input; with `new_coords` (scaled YOLOv4: the conv applied the logistic
    already) centre = (t * s - (s - 1) / 2 + cell) / grid and size = (2t)^2 * anchor / input.

    Every truth goes to the anchor of best shape among all the head's anchors (and to every
    other anchor with IoU above `iou_thresh`), in the cell holding its centre; a head learns it
    only when that anchor is in its mask. Predictions whose best IoU with any truth exceeds
    `truth_thresh` learn that truth too. Terms of a sample (the objectness, class and mse size
    terms have darknet's deltas as their gradients; for the centre and the IoU losses darknet
    leaves out the logistic's and the decoding's derivatives, and these are the losses its
    deltas stand for):
      box     mse: 0.5 (2 - w h) iou_normalizer |(offset, tw, th) - target|^2, or
              iou_normalizer (1 - IoU/GIoU/DIoU/CIoU) on the decoded box (gradient elementwise
              clipped at max_delta); with iou_thresh < 1 a cell's box terms are averaged over
              the classes it learns
      obj     obj_normalizer BCE(logit, 1) for assigned predictions; BCE(logit, 0) for the rest
              unless their best IoU with a truth exceeds ignore_thresh (objectness_smooth:
              those, and the assigned, learn that IoU instead)
      class   cls_normalizer BCE(logits, one-hot) for assigned predictions, smoothed to
              y (1 - eps) + eps / 2 by label_smooth_eps; two truths in one slot learn both classes
    Darknet applies its objectness and class deltas to the logits directly, which is the
    gradient of BCE; with `new_coords` the outputs are probabilities and the same deltas are
    the gradient of 0.5 (p - y)^2, which is what those heads use.
    """

    def __init__(self, head: dict):
        self.classes = head["classes"]
        self.img_w, self.img_h = head["img_wh"]
        self.heads = head["heads"]
        for h in self.heads:
            if h["iou_loss"] not in ("mse", "iou", "giou", "diou", "ciou"):
                raise ValueError(f"yolo head at layer {h.get('layer')}: iou_loss {h['iou_loss']!r} is not "
                                 "one of mse, iou, giou, diou, ciou")

    def split(self, out: torch.Tensor, k: int) -> torch.Tensor:
        """Head k's (B, A*(5+C), h, w) -> (B, A, h, w, 5+C), A = len(mask)."""
        b, ch, h, w = out.shape
        na = len(self.heads[k]["mask"])
        if ch != na * (5 + self.classes):
            raise ValueError(f"yolo head {k} gives {ch} channels, but {na} anchors x (5 + {self.classes} classes) "
                             f"= {na * (5 + self.classes)} are needed")
        return out.reshape(b, na, 5 + self.classes, h, w).permute(0, 1, 3, 4, 2)

    def decode(self, raw: torch.Tensor, k: int, anchors: torch.Tensor, cells: tuple[torch.Tensor, torch.Tensor],
               grid: tuple[int, int]) -> torch.Tensor:
        """raw (..., 4) box outputs of head k at cells (col, row) with anchors (..., 2) in pixels
        -> normalised (cx, cy, w, h)."""
        head = self.heads[k]
        s = head["scale_x_y"]
        gh, gw = grid
        if head["new_coords"]:
            xy = raw[..., :2] * s - (s - 1) / 2
            wh = (2 * raw[..., 2:4]) ** 2 * anchors
        else:
            xy = torch.sigmoid(raw[..., :2]) * s - (s - 1) / 2
            wh = torch.exp(raw[..., 2:4].clamp(max=10)) * anchors
        col, row = cells
        return torch.stack([(col + xy[..., 0]) / gw, (row + xy[..., 1]) / gh,
                            wh[..., 0] / self.img_w, wh[..., 1] / self.img_h], dim=-1)

    def boxes(self, p: torch.Tensor, k: int) -> torch.Tensor:
        """Predicted boxes of head k, p (B, A, h, w, 5+C) -> (B, A, h, w, 4) normalised (cx, cy, w, h)."""
        _, _, h, w, _ = p.shape
        anchors = self._anchors(k, p)[self.heads[k]["mask"]].view(1, -1, 1, 1, 2)
        cols = torch.arange(w, dtype=p.dtype, device=p.device).view(1, 1, 1, w)
        rows = torch.arange(h, dtype=p.dtype, device=p.device).view(1, 1, h, 1)
        return self.decode(p[..., :4], k, anchors, (cols, rows), (h, w))

    def _anchors(self, k: int, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.heads[k]["anchors"], dtype=like.dtype, device=like.device)  # (total, 2) pixels

    def _probabilities(self, p: torch.Tensor, k: int) -> torch.Tensor:
        """(objectness, class scores) as probabilities, (..., 1 + C)."""
        return p[..., 4:] if self.heads[k]["new_coords"] else torch.sigmoid(p[..., 4:])

    def __call__(self, outs, targets: torch.Tensor, batch_total: int) -> torch.Tensor:
        """outs: one (B, A*(5+C), h, w) tensor per head (a tensor alone for one head); targets:
        (B, N, 5) rows (class, cx, cy, w, h), class < 0 for padding; returns the summed loss of
        these samples divided by `batch_total`."""
        outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
        if len(outs) != len(self.heads):
            raise ValueError(f"{len(outs)} outputs given for {len(self.heads)} yolo heads")
        if outs[0].shape[0] == 0:
            return sum(out.sum() for out in outs) * 0.0
        targets = targets.to(outs[0].device, outs[0].dtype)
        loss = sum(self.head_loss(out, k, targets, batch_total) for k, out in enumerate(outs))
        return loss / batch_total

    def head_loss(self, out: torch.Tensor, k: int, targets: torch.Tensor, batch_total: int) -> torch.Tensor:
        """Head k's summed loss over the samples of `out` (not yet divided by the batch size)."""
        head = self.heads[k]
        p = self.split(out, k)  # (B, A, h, w, 5+C)
        bsz, na, gh, gw, _ = p.shape
        dev, dt = p.device, p.dtype
        anchors = self._anchors(k, p)  # (total, 2)
        mask = torch.tensor(head["mask"], dtype=torch.long, device=dev)
        slot_of = torch.full((len(anchors),), -1, dtype=torch.long, device=dev)  # anchor -> its slot in the mask
        slot_of[mask] = torch.arange(na, device=dev)
        valid = (targets[..., 0] >= 0) & (targets[..., 0] < self.classes)  # (B, N)

        with torch.no_grad():
            pred = self.boxes(p.detach(), k)  # (B, A, h, w, 4)
            if targets.shape[1]:
                iou = box_iou_cxcywh(pred.view(bsz, -1, 4), targets[..., 1:5])  # (B, A*h*w, N)
                best_iou, best_t = iou.masked_fill(~valid.unsqueeze(1), -1.0).max(dim=-1)
                best_iou = best_iou.clamp(min=0).view(bsz, na, gh, gw)
                best_t = best_t.view(bsz, na, gh, gw)
            else:
                best_iou = torch.zeros(bsz, na, gh, gw, dtype=dt, device=dev)
                best_t = torch.zeros(bsz, na, gh, gw, dtype=torch.long, device=dev)

            # (sample, truth, anchor) triples: the best anchor by shape, and others above iou_thresh
            bi, ni = valid.nonzero(as_tuple=True)
            t = targets[bi, ni]  # (T, 5)
            twh = torch.stack([t[:, 3] * self.img_w, t[:, 4] * self.img_h], dim=-1)  # (T, 2) pixels
            inter = torch.minimum(twh[:, None], anchors[None]).prod(-1)  # (T, total): boxes sharing a centre
            shape_iou = inter / (twh.prod(-1)[:, None] + anchors.prod(-1)[None] - inter).clamp(min=1e-12)
            take = torch.zeros_like(shape_iou, dtype=torch.bool)
            if len(t):
                take[torch.arange(len(t), device=dev), shape_iou.argmax(dim=1)] = True
            if head["iou_thresh"] < 1:
                take |= shape_iou > head["iou_thresh"]
            take &= (slot_of >= 0)[None]
            ti, ai = take.nonzero(as_tuple=True)
            pb, pa, pt = bi[ti], slot_of[ai], t[ti]
            pi = (pt[:, 1] * gw).long().clamp(0, gw - 1)
            pj = (pt[:, 2] * gh).long().clamp(0, gh - 1)
            # predictions that overlap a truth by more than truth_thresh learn it too
            if head["truth_thresh"] < 1 and targets.shape[1]:
                xb, xa, xj, xi = (best_iou > head["truth_thresh"]).nonzero(as_tuple=True)
                pb, pa, pj, pi = torch.cat([pb, xb]), torch.cat([pa, xa]), torch.cat([pj, xj]), torch.cat([pi, xi])
                pt = torch.cat([pt, targets[xb, best_t[xb, xa, xj, xi]]])
            slot = ((pb * na + pa) * gh + pj) * gw + pi  # each pair's flat (sample, anchor, row, col)
            assigned = torch.zeros(bsz * na * gh * gw, dtype=torch.bool, device=dev)
            assigned[slot] = True
            assigned = assigned.view(bsz, na, gh, gw)
            tcls = torch.zeros(bsz * na * gh * gw, self.classes, dtype=dt, device=dev)
            tcls[slot, pt[:, 0].long()] = 1.0
            per_slot = tcls[slot].sum(-1) if head["iou_thresh"] < 1 else torch.ones(len(slot), dtype=dt, device=dev)
            tcls = tcls.view(bsz, na, gh, gw, self.classes)

        # box terms, one per (truth, slot) pair
        flat = p.reshape(-1, 5 + self.classes)
        raw = flat[slot, :4]  # (P, 4)
        anchor = anchors[mask[pa]]  # (P, 2)
        scale = 2.0 - pt[:, 3] * pt[:, 4]
        if head["iou_loss"] == "mse":
            s = head["scale_x_y"]
            xy = raw[:, :2] if head["new_coords"] else torch.sigmoid(raw[:, :2])
            xy = xy * s - (s - 1) / 2
            size = torch.stack([pt[:, 3] * self.img_w, pt[:, 4] * self.img_h], -1).clamp(min=1e-9)  # pixels
            twh = torch.sqrt(size / (4 * anchor)) if head["new_coords"] else torch.log(size / anchor)
            target = torch.cat([torch.stack([pt[:, 1] * gw - pi, pt[:, 2] * gh - pj], -1), twh], -1)
            box = 0.5 * scale * ((torch.cat([xy, raw[:, 2:4]], -1) - target) ** 2).sum(-1)
        else:
            if math.isfinite(head["max_delta"]):
                raw = _ClipGrad.apply(raw, head["max_delta"] / batch_total)
            decoded = self.decode(raw, k, anchor, (pi.to(dt), pj.to(dt)), (gh, gw))
            box = iou_loss(decoded, pt[:, 1:5], head["iou_loss"])
        loss = head["iou_normalizer"] * (box / per_slot).sum()

        # objectness: 1 for the assigned, 0 for the rest that overlap no truth by more than ignore_thresh
        with torch.no_grad():
            overlaps = best_iou > head["ignore_thresh"]
            if head["objectness_smooth"]:
                weight = torch.ones_like(assigned)
                obj_target = torch.where(assigned | overlaps, best_iou, torch.zeros_like(best_iou))
            else:
                weight = assigned | ~overlaps
                obj_target = assigned.to(dt)
        loss = loss + head["obj_normalizer"] * self._binary(p[..., 4], obj_target, k)[weight].sum()
        # classes of the assigned
        eps = head["label_smooth_eps"]
        cls_target = tcls[assigned] * (1 - eps) + 0.5 * eps
        loss = loss + head["cls_normalizer"] * self._binary(p[assigned][:, 5:], cls_target, k).sum()
        return loss

    def _binary(self, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
        """Elementwise loss whose gradient is darknet's delta: BCE on logits, or 0.5 (p - y)^2 on
        the probabilities a `new_coords` head gives."""
        if self.heads[k]["new_coords"]:
            return 0.5 * (x - y) ** 2
        return F.binary_cross_entropy_with_logits(x, y, reduction="none")

    @torch.no_grad()
    def detections(self, outs, conf_thresh: float = 0.005, nms_iou: float = 0.45,
                   max_det: int = 100) -> list[torch.Tensor]:
        """Per image, rows (class, score, cx, cy, w, h), the boxes of every head together after
        one class-wise non-maximum suppression; score = objectness x class probability."""
        outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
        boxes, scores = [], []
        for k, out in enumerate(outs):
            p = self.split(out, k)
            boxes.append(self.boxes(p, k).flatten(1, 3))  # (B, A*h*w, 4)
            prob = self._probabilities(p, k).flatten(1, 3)  # (B, A*h*w, 1+C)
            scores.append(prob[..., :1] * prob[..., 1:])
        return select_detections(torch.cat(boxes, 1), torch.cat(scores, 1), conf_thresh, nms_iou, max_det,
                                 MAX_CANDIDATES)


class DetectionLoss:
    """YOLOv1's detection layer (darknet's src/detection_layer.c).

    The output, one vector per sample from a [connected] layer, holds for side x side cells:
    first every cell's class scores (C each, softmaxed when `softmax`), then every cell's `num`
    confidences, then every cell's `num` boxes (x, y offsets in the cell, w, h of the image;
    the square roots of w and h when `sqrt`). A cell holding a truth's centre (the last one
    listed, when several) learns it with the box that overlaps it best (or lies nearest, when
    none overlaps). Terms, every gradient equal to darknet's delta:
      confidence  0.5 noobject_scale c^2 for every box but the responsible ones, which get
                  0.5 object_scale (c - 1)^2 (c - IoU with `rescore`)
      class       0.5 class_scale |p - one-hot|^2 for cells with a truth; with `softmax`
                  darknet's delta on the softmax goes straight to the logits: cross-entropy
      box         0.5 coord_scale |box - truth|^2
    """

    def __init__(self, head: dict):
        self.classes = head["classes"]
        self.side = head["side"]
        self.num = head["num"]
        if head.get("coords", 4) != 4:
            raise ValueError(f"detection head: coords={head['coords']}, only 4 is supported")
        self.sqrt, self.rescore, self.softmax = head["sqrt"], head["rescore"], head["softmax"]
        self.object_scale = head["object_scale"]
        self.noobject_scale = head["noobject_scale"]
        self.class_scale = head["class_scale"]
        self.coord_scale = head["coord_scale"]

    def split(self, out: torch.Tensor):
        """(B, S*S*(C + N*5)) -> class scores (B, S*S, C), confidences (B, S*S, N), boxes (B, S*S, N, 4)."""
        out = out.flatten(1)
        cells, c, n = self.side * self.side, self.classes, self.num
        if out.shape[1] != cells * (c + 5 * n):
            raise ValueError(f"detection head gives {out.shape[1]} values, but {self.side}x{self.side} cells x "
                             f"({c} classes + {n} x 5) = {cells * (c + 5 * n)} are needed")
        b = out.shape[0]
        return (out[:, :cells * c].view(b, cells, c), out[:, cells * c:cells * (c + n)].view(b, cells, n),
                out[:, cells * (c + n):].view(b, cells, n, 4))

    def cell_boxes(self, box: torch.Tensor) -> torch.Tensor:
        """Boxes (..., 4) as output -> (x, y offsets / side, w, h): darknet's frame of one cell."""
        wh = box[..., 2:] ** 2 if self.sqrt else box[..., 2:]
        return torch.cat([box[..., :2] / self.side, wh], dim=-1)

    def __call__(self, out: torch.Tensor, targets: torch.Tensor, batch_total: int) -> torch.Tensor:
        """out: (B, S*S*(C + N*5)); targets: (B, N, 5) rows (class, cx, cy, w, h), class < 0 for
        padding; returns the summed loss of these samples divided by `batch_total`."""
        if out.shape[0] == 0:
            return out.sum() * 0.0
        cls, conf, box = self.split(out)
        bsz, cells, n = conf.shape
        side, dev, dt = self.side, out.device, out.dtype
        targets = targets.to(dev, dt)
        with torch.no_grad():
            valid = (targets[..., 0] >= 0) & (targets[..., 0] < self.classes)
            bi, ni = valid.nonzero(as_tuple=True)
            t = targets[bi, ni]  # (T, 5)
            col = (t[:, 1] * side).long().clamp(0, side - 1)
            row = (t[:, 2] * side).long().clamp(0, side - 1)
            cell = bi * cells + row * side + col
            # several truths in one cell: the last one listed is the cell's
            order = torch.arange(len(cell), device=dev)
            last = torch.full((bsz * cells,), -1, dtype=torch.long, device=dev).scatter_reduce(
                0, cell, order, reduce="amax", include_self=True)
            keep = last[cell] == order
            cell, t, col, row = cell[keep], t[keep], col[keep], row[keep]
            truth = torch.stack([(t[:, 1] * side - col) / side, (t[:, 2] * side - row) / side, t[:, 3], t[:, 4]], -1)
            mine = self.cell_boxes(box.detach().reshape(-1, n, 4)[cell])  # (K, N, 4)
            iou = box_iou_cxcywh(mine, truth.unsqueeze(1)).squeeze(-1)  # (K, N)
            rmse = ((mine - truth.unsqueeze(1)) ** 2).sum(-1).sqrt()
            best = torch.where((iou > 0).any(-1), iou.argmax(-1), rmse.argmin(-1))
            responsible = torch.zeros(bsz * cells, n, dtype=torch.bool, device=dev)
            responsible[cell, best] = True
            obj_target = iou[torch.arange(len(cell), device=dev), best] if self.rescore else \
                torch.ones(len(cell), dtype=dt, device=dev)
            tbox = torch.cat([truth[:, :2] * side, truth[:, 2:].clamp(min=0).sqrt() if self.sqrt else truth[:, 2:]], -1)

        conf = conf.reshape(-1, n)
        loss = 0.5 * self.noobject_scale * (conf[~responsible] ** 2).sum()
        loss = loss + 0.5 * self.object_scale * ((conf[cell, best] - obj_target) ** 2).sum()
        scores = cls.reshape(-1, self.classes)[cell]  # (K, C)
        if self.softmax:
            loss = loss + self.class_scale * F.cross_entropy(scores, t[:, 0].long(), reduction="sum")
        else:
            one_hot = F.one_hot(t[:, 0].long(), self.classes).to(dt)
            loss = loss + 0.5 * self.class_scale * ((scores - one_hot) ** 2).sum()
        loss = loss + 0.5 * self.coord_scale * ((box.reshape(-1, n, 4)[cell, best] - tbox) ** 2).sum()
        return loss / batch_total

    @torch.no_grad()
    def detections(self, out: torch.Tensor, conf_thresh: float = 0.005, nms_iou: float = 0.45,
                   max_det: int = 100) -> list[torch.Tensor]:
        """Per image, rows (class, score, cx, cy, w, h) after class-wise non-maximum suppression;
        score = confidence x class probability."""
        cls, conf, box = self.split(out)
        bsz, cells, n = conf.shape
        idx = torch.arange(cells, device=out.device)
        col = (idx % self.side).to(out.dtype).view(1, cells, 1)
        row = (idx // self.side).to(out.dtype).view(1, cells, 1)
        wh = box[..., 2:] ** 2 if self.sqrt else box[..., 2:].clamp(min=0)
        boxes = torch.stack([(box[..., 0] + col) / self.side, (box[..., 1] + row) / self.side,
                             wh[..., 0], wh[..., 1]], dim=-1).flatten(1, 2)  # (B, S*S*N, 4)
        probs = torch.softmax(cls, -1) if self.softmax else cls  # (B, S*S, C)
        scores = (conf.unsqueeze(-1) * probs.unsqueeze(2)).flatten(1, 2)  # (B, S*S*N, C)
        return select_detections(boxes, scores, conf_thresh, nms_iou, max_det, MAX_CANDIDATES)


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
