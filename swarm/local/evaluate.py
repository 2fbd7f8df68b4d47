"""Held-out evaluation: mAP@0.5 for detectors, top-1 accuracy for classifiers."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swarm.data import class_targets, make_batch
from swarm.zoo.loss import box_iou_cxcywh, make_loss


def average_precision(scores: np.ndarray, matched: np.ndarray, n_truth: int) -> float:
    """VOC-style AP (area under the interpolated precision-recall curve, all points)."""
    if n_truth == 0:
        return float("nan")
    order = np.argsort(-scores, kind="stable")
    tp = matched[order].astype(np.float64)
    fp = 1.0 - tp
    tp, fp = np.cumsum(tp), np.cumsum(fp)
    recall = tp / n_truth
    precision = tp / np.maximum(tp + fp, 1e-12)
    mrec = np.concatenate([[0.0], recall, [1.0]])
    mpre = np.concatenate([[0.0], precision, [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    steps = np.nonzero(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[steps + 1] - mrec[steps]) * mpre[steps + 1]))


def mean_average_precision(detections: list[np.ndarray], truths: list[np.ndarray], num_classes: int,
                           iou_thresh: float = 0.5) -> tuple[float, list[float]]:
    """detections: per image rows (class, score, cx, cy, w, h); truths: rows (class, cx, cy, w, h).

    Returns (mAP over classes that have truths, per-class AP with nan for absent classes)."""
    per_class = []
    for c in range(num_classes):
        scores, matched, n_truth = [], [], 0
        for det, tru in zip(detections, truths):
            t = tru[tru[:, 0] == c]
            n_truth += len(t)
            d = det[det[:, 0] == c]
            if not len(d):
                continue
            d = d[np.argsort(-d[:, 1], kind="stable")]
            used = np.zeros(len(t), dtype=bool)
            iou = box_iou_cxcywh(torch.from_numpy(d[:, 2:6]), torch.from_numpy(t[:, 1:5])).numpy() if len(t) else None
            for k in range(len(d)):
                hit = False
                if iou is not None:
                    j = int(np.argmax(iou[k]))
                    if iou[k, j] >= iou_thresh and not used[j]:
                        used[j] = hit = True
                scores.append(d[k, 1])
                matched.append(hit)
        per_class.append(average_precision(np.array(scores), np.array(matched, dtype=bool), n_truth))
    present = [ap for ap in per_class if not np.isnan(ap)]
    return (float(np.mean(present)) if present else 0.0), per_class


@dataclass
class EvalResult:
    metric: str  # "mAP@0.5" or "top-1 accuracy"
    value: float
    samples: int
    per_class: list[float] | None = None

    def __str__(self) -> str:
        return f"{self.metric} = {self.value:.3f} on {self.samples} held-out images"


@torch.no_grad()
def evaluate(net, desc, dataset, batch_size: int = 16) -> EvalResult:
    """Run the network in eval mode (BatchNorm running statistics) over a whole split."""
    was_training = net.training
    net.eval()
    loss = make_loss(desc)
    dets, truths, correct = [], [], 0
    try:
        for start in range(0, len(dataset), batch_size):
            idx = range(start, min(start + batch_size, len(dataset)))
            images, targets = make_batch(dataset, idx)
            out = net(torch.from_numpy(images).to(next(net.parameters()).device))
            if desc.detects:  # every detecting loss finds boxes the same way, from one head or several
                dets += [d.cpu().numpy() for d in loss.detections(out)]
                truths += [t[t[:, 0] >= 0] for t in targets]
            else:
                correct += int((out.flatten(1).argmax(1).cpu().numpy() == class_targets(targets)).sum())
    finally:
        net.train(was_training)
    if desc.detects:
        value, per_class = mean_average_precision(dets, truths, loss.classes)
        return EvalResult("mAP@0.5", value, len(dataset), per_class)
    return EvalResult("top-1 accuracy", correct / max(1, len(dataset)), len(dataset))
