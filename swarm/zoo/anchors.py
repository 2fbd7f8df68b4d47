"""Anchors fitted to a data set's boxes, as darknet's `detector calc_anchors` fits them:
k-means over the training boxes' widths and heights (in pixels of the network's input),
with 1 - IoU (boxes sharing a centre) as the distance.

    wh = box_sizes(train_set)                               # (n, 2) pixels at the input size
    anchors, mean_iou = fit_anchors(wh, 6)                  # sorted by area
    text = cfg_with_fitted_anchors(cfg_text, desc, wh)      # the .cfg with them in every [yolo]

A [yolo] head learns a box only when the anchor of best shape for it is in the head's `mask`,
so the clusters go to the anchors the masks use (yolov4-tiny's masks leave its first anchor
out); an anchor no mask uses keeps the .cfg's value.
"""
from __future__ import annotations

import numpy as np

from swarm.errors import SwarmError

RESTARTS = 10  # k-means runs from different starts; the best mean IoU is kept
MAX_ROUNDS = 300
MAX_BOXES = 5000  # more boxes than this: k-means runs on this many drawn from them (a second or two)


def shape_iou(wh: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """IoU of boxes (n, 2) with anchors (k, 2) placed on a common centre: (n, k)."""
    inter = np.minimum(wh[:, None, 0], anchors[None, :, 0]) * np.minimum(wh[:, None, 1], anchors[None, :, 1])
    return inter / (wh.prod(-1)[:, None] + anchors.prod(-1)[None] - inter)


def mean_best_iou(wh: np.ndarray, anchors: np.ndarray) -> float:
    """The mean over the boxes of their best IoU with an anchor (darknet's "avg IoU")."""
    return float(shape_iou(wh, anchors).max(1).mean()) if len(wh) and len(anchors) else 0.0


def fit_anchors(wh: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, float]:
    """k anchors (k, 2) for boxes `wh` (n, 2), sorted by area, and their mean best IoU.

    k-means with distance 1 - IoU; each run starts from k boxes drawn k-means++ style (each
    next one with odds growing with its distance from those drawn), and the run with the best
    mean IoU is kept (over at most MAX_BOXES of the boxes, drawn by the seed). Deterministic for
    a given seed."""
    wh = np.asarray(wh, dtype=np.float64).reshape(-1, 2)
    wh = wh[(wh > 0).all(1)]
    if len(wh) == 0:
        raise SwarmError("no boxes to fit anchors to")
    distinct = np.unique(wh, axis=0)
    if len(distinct) < k:
        raise SwarmError(f"{k} anchors need at least {k} boxes of different sizes; the data has {len(distinct)}")
    rng = np.random.default_rng(seed)
    every = wh
    if len(wh) > MAX_BOXES:
        wh = wh[rng.choice(len(wh), MAX_BOXES, replace=False)]
        distinct = np.unique(wh, axis=0)
    best, best_iou = None, -1.0
    for _ in range(RESTARTS):
        centres = [distinct[rng.integers(len(distinct))]]
        while len(centres) < k:
            d = 1.0 - shape_iou(distinct, np.array(centres)).max(1)
            odds = d ** 2
            total = odds.sum()
            centres.append(distinct[rng.choice(len(distinct), p=odds / total)] if total > 0
                           else distinct[rng.integers(len(distinct))])
        c = np.array(centres)
        for _ in range(MAX_ROUNDS):
            nearest = shape_iou(wh, c).argmax(1)
            new = np.array([wh[nearest == j].mean(0) if (nearest == j).any() else c[j] for j in range(k)])
            if np.allclose(new, c):
                break
            c = new
        iou = mean_best_iou(wh, c)
        if iou > best_iou:
            best, best_iou = c, iou
    if len(every) > len(wh):
        best_iou = mean_best_iou(every, best)
    return best[np.argsort(best.prod(1), kind="stable")], best_iou


def box_sizes(dataset) -> np.ndarray:
    """Every box of a detection data set, (n, 2) width and height in pixels of the network's
    input, as training sees them before augmentation (a photo letterboxed into the input)."""
    from swarm.data.shapes import SyntheticShapes
    from swarm.data.yolo_dir import Letterbox, YoloDirectory

    width, height = dataset.img_size.width, dataset.img_size.height
    rows = []
    if isinstance(dataset, SyntheticShapes):  # drawn at the input's size: relative sizes as they are
        for i in range(len(dataset)):
            rows += [(w * width, h * height) for _, _, _, w, h, _ in dataset.scene(i)]
    elif isinstance(dataset, YoloDirectory):
        from PIL import Image

        for path, boxes in dataset.samples:
            if not len(boxes):
                continue
            try:
                with Image.open(path) as im:  # the header only: the size, not the pixels
                    placed = Letterbox((im.width, im.height), dataset.img_size).to_input(boxes)
            except (OSError, ValueError, SyntaxError) as exc:
                raise SwarmError(f"{path}: cannot read the image's size ({exc})") from None
            rows += [(w * width, h * height) for w, h in placed[:, 3:5]]
    else:
        raise SwarmError(f"{dataset.name} has no boxes (a data set of one class per picture): anchors are fitted to "
                         "the boxes of a detection data set")
    return np.array(rows, dtype=np.float64).reshape(-1, 2)


def yolo_anchor_slots(desc) -> tuple[list[tuple[float, float]], list[int]]:
    """(the anchors of the network's [yolo] heads at its input size, the indices its masks use).
    The heads must share one anchor list, as darknet's cfgs write it."""
    if desc.loss != "yolo":
        kind = {"region": "a [region] head (YOLOv2)", "detection": "a [detection] head (YOLOv1)"}.get(
            desc.loss, "no detection head")
        raise SwarmError(f"{desc.name} has {kind}: anchors are fitted for [yolo] heads (YOLOv3 and later)")
    heads = desc.extra["heads"]
    anchors = [tuple(a) for a in heads[0]["anchors"]]
    if any([tuple(a) for a in h["anchors"]] != anchors for h in heads[1:]):
        raise SwarmError(f"{desc.name}: its [yolo] heads have different anchors=; fitting needs one list for all")
    used = sorted({m for h in heads for m in h["mask"]})
    return anchors, used


def fitted_anchors(desc, wh: np.ndarray, seed: int = 0) -> tuple[list[tuple[float, float]], float, float]:
    """(the network's anchors with those its masks use fitted to boxes `wh`, at its input size;
    the mean best IoU of the boxes with the anchors the masks use before, and after)."""
    anchors, used = yolo_anchor_slots(desc)
    clusters, _ = fit_anchors(wh, len(used), seed)
    new = list(anchors)
    for slot, (w, h) in zip(used, clusters):
        new[slot] = (float(w), float(h))
    return new, learned_iou(wh, anchors, used), learned_iou(wh, new, used)


def learned_iou(wh: np.ndarray, anchors, used: list[int]) -> float:
    """The mean over the boxes of the IoU with their anchor of best shape, 0 for a box whose
    best anchor no head's mask holds (no head learns it)."""
    if not len(wh):
        return 0.0
    iou = shape_iou(np.asarray(wh, dtype=np.float64), np.asarray(anchors, dtype=np.float64))
    best = iou.argmax(1)
    return float(np.where(np.isin(best, used), iou.max(1), 0.0).mean())


def anchors_line(anchors) -> str:
    """darknet's `anchors=` value, whole pixels as calc_anchors prints them."""
    return ",  ".join(f"{round(w)},{round(h)}" for w, h in anchors)


def cfg_with_anchors(cfg_text: str, source: str, desc, anchors) -> str:
    """`cfg_text` with every [yolo] head's anchors= set to `anchors`, given in pixels of the
    network's input (desc.img_size) and written in pixels of the .cfg's own [net] size, which
    is how the file states them (build scales them to the input again)."""
    from swarm.zoo import native_size
    from swarm.zoo.darknet import parse_cfg, set_options

    sections = parse_cfg(cfg_text, source)
    native = native_size(sections)
    factor = max(desc.img_size.width / native.width, desc.img_size.height / native.height)
    value = ", ".join(f"{v / factor:.6g}" for a in anchors for v in a)
    edits = [(n, "anchors", value) for n, s in enumerate(sections) if s.name == "yolo"]
    return set_options(cfg_text, sections, edits)
