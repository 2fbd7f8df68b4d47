"""Held-out evaluation: mAP@0.5 and mAP@0.5:0.95 for detectors (COCO's definition: 101 recall
points, IoU thresholds 0.5, 0.55, ..., 0.95), top-1 and top-5 accuracy for classifiers. The
VOC form of AP (all points, one IoU threshold) is kept beside it for the tests that pin it."""
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


COCO_RECALLS = np.linspace(0.0, 1.0, 101)
COCO_IOUS = np.linspace(0.5, 0.95, 10)


def coco_average_precision(scores: np.ndarray, matched: np.ndarray, n_truth: int) -> float:
    """COCO's AP: the precision envelope (the best precision at this recall or beyond) read at
    the 101 recalls 0, 0.01, ..., 1 (0 beyond the last recall reached), averaged."""
    if n_truth == 0:
        return float("nan")
    if not len(scores):  # truths, and nothing found
        return 0.0
    order = np.argsort(-scores, kind="stable")
    tp = np.cumsum(matched[order].astype(np.float64))
    fp = np.cumsum(1.0 - matched[order].astype(np.float64))
    recall = tp / n_truth
    precision = np.maximum.accumulate((tp / np.maximum(tp + fp, 1e-12))[::-1])[::-1]
    at = np.searchsorted(recall, COCO_RECALLS, side="left")
    return float(np.where(at < len(precision), precision[np.minimum(at, len(precision) - 1)], 0.0).mean())


def coco_mean_average_precision(detections: list[np.ndarray], truths: list[np.ndarray], num_classes: int,
                                ious=COCO_IOUS) -> tuple[np.ndarray, np.ndarray]:
    """COCO's matching and AP for every IoU threshold at once: per class, its detections in
    order of score over all images, each matched to the unmatched truth of its image it
    overlaps most, if by at least the threshold. Returns (mAP per threshold over the classes
    that have truths, AP per class and threshold with nan for absent classes)."""
    ious = np.asarray(ious, dtype=np.float64)
    per_class = np.full((num_classes, len(ious)), np.nan)
    for c in range(num_classes):
        scores, matched, n_truth = [], [], 0
        for det, tru in zip(detections, truths):
            t = tru[tru[:, 0] == c]
            n_truth += len(t)
            d = det[det[:, 0] == c]
            if not len(d):
                continue
            d = d[np.argsort(-d[:, 1], kind="stable")]
            overlap = (box_iou_cxcywh(torch.from_numpy(d[:, 2:6]), torch.from_numpy(t[:, 1:5])).numpy()
                       if len(t) else np.zeros((len(d), 0)))
            used = np.zeros((len(ious), len(t)), dtype=bool)
            for k in range(len(d)):
                hits = np.zeros(len(ious), dtype=bool)
                for q, thresh in enumerate(ious):
                    free = np.where(used[q], -1.0, overlap[k])
                    if len(t) and free.max() >= thresh:
                        used[q, int(free.argmax())] = hits[q] = True
                scores.append(d[k, 1])
                matched.append(hits)
        if n_truth:
            m = np.array(matched, dtype=bool).reshape(-1, len(ious))
            per_class[c] = [coco_average_precision(np.array(scores), m[:, q], n_truth) for q in range(len(ious))]
    present = ~np.isnan(per_class[:, 0])
    means = per_class[present].mean(axis=0) if present.any() else np.zeros(len(ious))
    return means, per_class


@dataclass
class EvalResult:
    metric: str  # "mAP@0.5" or "top-1 accuracy"
    value: float
    samples: int
    per_class: list[float] | None = None  # a detector's AP@0.5 per class (nan: none in the split)
    more: dict[str, float] | None = None  # mAP@0.5:0.95, or top-5 accuracy (with more than five classes)

    def __str__(self) -> str:
        shown = [f"{self.metric} = {self.value:.3f}"] + [f"{k} = {v:.3f}" for k, v in (self.more or {}).items()]
        return f"{', '.join(shown)} on {self.samples} held-out images"


@torch.no_grad()
def evaluate(net, desc, dataset, batch_size: int = 16) -> EvalResult:
    """Run the network in eval mode (BatchNorm running statistics) over a whole split."""
    was_training = net.training
    net.eval()
    loss = make_loss(desc)
    dets, truths, correct, top5 = [], [], 0, 0
    try:
        for start in range(0, len(dataset), batch_size):
            idx = range(start, min(start + batch_size, len(dataset)))
            images, targets = make_batch(dataset, idx)
            out = net(torch.from_numpy(images).to(next(net.parameters()).device))
            if desc.detects:  # every detecting loss finds boxes the same way, from one head or several
                dets += [d.cpu().numpy() for d in loss.detections(out)]
                truths += [t[t[:, 0] >= 0] for t in targets]
            else:
                scores, want = out.flatten(1).cpu(), torch.from_numpy(class_targets(targets))
                correct += int((scores.argmax(1) == want).sum())
                best = scores.topk(min(5, scores.shape[1]), dim=1).indices
                top5 += int((best == want[:, None]).any(1).sum())
    finally:
        net.train(was_training)
    n = max(1, len(dataset))
    if desc.detects:
        means, per_class = coco_mean_average_precision(dets, truths, loss.classes)
        return EvalResult("mAP@0.5", float(means[0]), len(dataset), [float(v) for v in per_class[:, 0]],
                          {"mAP@0.5:0.95": float(means.mean())})
    more = {"top-5 accuracy": top5 / n} if loss_classes(desc) > 5 else None
    return EvalResult("top-1 accuracy", correct / n, len(dataset), more=more)


def loss_classes(desc) -> int:
    """How many classes a classifier's last layer scores."""
    return int(np.prod(desc.layers[desc.outputs[-1]].out_shape))
