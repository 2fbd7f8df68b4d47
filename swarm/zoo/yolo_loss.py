"""The loss of darknet's [yolo] heads (YOLOv3 and later), every head of a network at once."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from swarm.zoo.boxes import MAX_CANDIDATES, box_iou_cxcywh, iou_loss, select_detections


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
    `truth_thresh` learn that truth too. Terms of a sample, each with darknet's deltas as its
    gradient by the head's outputs (darknet's yolo layer hands its deltas back unchanged, so
    the box terms' gradients leave out the logistic's and the decoding's derivatives: the
    centre's reach tx, ty as they are, the size's through exp(tw) alone, or as they are with
    `new_coords`; the option normalizers are sized for these gradients):
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
        # darknet's deltas reach the outputs unchanged (its yolo layer's backward copies them):
        # the centre's as if d(centre)/d(tx) were 1, the size's through exp(tw) alone
        through = raw - raw.detach()
        if head["iou_loss"] == "mse":
            s = head["scale_x_y"]
            xy = raw[:, :2].detach() if head["new_coords"] else torch.sigmoid(raw[:, :2].detach())
            xy = xy * s - (s - 1) / 2 + through[:, :2]
            size = torch.stack([pt[:, 3] * self.img_w, pt[:, 4] * self.img_h], -1).clamp(min=1e-9)  # pixels
            twh = torch.sqrt(size / (4 * anchor)) if head["new_coords"] else torch.log(size / anchor)
            target = torch.cat([torch.stack([pt[:, 1] * gw - pi, pt[:, 2] * gh - pj], -1), twh], -1)
            box = 0.5 * scale * ((torch.cat([xy, raw[:, 2:4]], -1) - target) ** 2).sum(-1)
        else:
            if math.isfinite(head["max_delta"]):
                raw = _ClipGrad.apply(raw, head["max_delta"] / batch_total)
            with torch.no_grad():
                decoded = self.decode(raw, k, anchor, (pi.to(dt), pj.to(dt)), (gh, gw))
                size_factor = 1.0 if head["new_coords"] else torch.exp(raw[:, 2:4].clamp(max=10))
            decoded = decoded + torch.cat([through[:, :2], through[:, 2:4] * size_factor], -1)
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
