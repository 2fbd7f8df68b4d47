"""The loss of YOLOv1's [detection] layer: boxes and classes per cell of one vector."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from swarm.zoo.boxes import MAX_CANDIDATES, box_iou_cxcywh, select_detections


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
