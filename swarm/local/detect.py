"""A trained checkpoint run on image files: boxes for a detector, the top classes for a
classifier, drawn on copies of the images and written as YOLO-format text and JSON."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from planner.image_size import ImageSize
from swarm.data.shapes import CLASSES as SHAPES
from swarm.data import data_class_names
from swarm.data.yolo_dir import image_to_input
from swarm.errors import SwarmError
from swarm.local.checkpoint import load_network
from swarm.zoo.loss import make_loss

# one colour per class, in turn (Tableau's ten, then darker ones)
PALETTE = ["#4E79A7", "#F28E2B", "#E15759", "#76B7B2", "#59A14F", "#EDC948", "#B07AA1", "#FF9DA7", "#9C755F",
           "#BAB0AC", "#1F77B4", "#D62728", "#2CA02C", "#9467BD", "#8C564B", "#E377C2", "#7F7F7F", "#BCBD22"]


@dataclass
class Prediction:
    image: Path
    width: int
    height: int
    boxes: list[dict] = field(default_factory=list)  # detector: class, name, score, cx, cy, w, h (relative), box (pixels)
    top: list[dict] = field(default_factory=list)  # classifier: class, name, score, best first

    def as_dict(self) -> dict:
        d = {"image": str(self.image), "width": self.width, "height": self.height}
        if self.top:
            d["top"] = self.top
        else:
            d["boxes"] = self.boxes
        return d


class Detector:
    """A checkpoint's network in eval mode (BatchNorm running statistics), with its class names."""

    def __init__(self, state: dict, conf: float = 0.25, nms: float = 0.45, top_k: int = 5,
                 img_size: ImageSize | None = None, where: str = "the checkpoint"):
        config = state.get("config", {})
        self.net, self.desc, _ = load_network(state, where, img_size)  # at the trained size, or img_size
        self.net.eval()
        self.loss = make_loss(self.desc)
        self.conf, self.nms, self.top_k = conf, nms, top_k
        self.names = names_for(config.get("data"), self.num_classes)

    @property
    def is_detector(self) -> bool:
        return self.desc.detects  # region, yolo or detection: boxes from `self.loss.detections`

    @property
    def num_classes(self) -> int:
        return self.loss.classes if self.is_detector else int(np.prod(self.desc.layers[-1].out_shape))

    def name(self, c: int) -> str:
        return self.names[c] if c < len(self.names) else str(c)

    @torch.no_grad()
    def predict(self, images: list, paths: list[Path]) -> list[Prediction]:
        """Predictions for PIL images (any size; each is letterboxed as in training, and the
        boxes mapped back onto the image)."""
        size, channels = self.desc.img_size, self.desc.in_channels
        inputs = [image_to_input(im, size, channels) for im in images]
        batch = torch.from_numpy(np.stack([arr for arr, _ in inputs]))
        out = self.net(batch)
        results = []
        if self.is_detector:
            for im, path, (_, letterbox), det in zip(images, paths, inputs,
                                                     self.loss.detections(out, self.conf, self.nms)):
                p = Prediction(path, im.width, im.height)
                for c, score, *xywh in det.tolist():
                    cx, cy, w, h = letterbox.to_image(*xywh)
                    box = [(cx - w / 2) * im.width, (cy - h / 2) * im.height, (cx + w / 2) * im.width,
                           (cy + h / 2) * im.height]
                    p.boxes.append({"class": int(c), "name": self.name(int(c)), "score": round(score, 4),
                                    "cx": cx, "cy": cy, "w": w, "h": h, "box": [round(v, 1) for v in box]})
                results.append(p)
            return results
        probs = torch.softmax(out.flatten(1).double(), dim=1)
        scores, classes = probs.topk(min(self.top_k, probs.shape[1]), dim=1)
        for im, path, s, c in zip(images, paths, scores.tolist(), classes.tolist()):
            results.append(Prediction(path, im.width, im.height,
                                      top=[{"class": k, "name": self.name(k), "score": round(v, 4)}
                                           for k, v in zip(c, s)]))
        return results


def names_for(data: str | None, count: int) -> list[str]:
    """Class names of the data a checkpoint was trained on, when this machine has them."""
    if data is None or data == "synthetic":
        return list(SHAPES)
    names = data_class_names(Path(data)) if Path(data).is_dir() else None
    return list(names) if names else [str(c) for c in range(count)]


def yolo_lines(p: Prediction) -> str:
    """YOLO-format predictions: `class cx cy w h score` per box (relative), or `class score`
    per class for a classifier."""
    if p.top:
        return "".join(f"{t['class']} {t['score']:.4f}\n" for t in p.top)
    return "".join(f"{b['class']} {b['cx']:.6f} {b['cy']:.6f} {b['w']:.6f} {b['h']:.6f} {b['score']:.4f}\n"
                   for b in p.boxes)


def draw(im, p: Prediction):
    """A copy of the image with the boxes (or the top classes) drawn on it."""
    from PIL import ImageDraw, ImageFont

    out = im.convert("RGB")
    pen = ImageDraw.Draw(out)
    scale = max(out.width, out.height)
    try:
        font = ImageFont.load_default(size=max(11, scale // 40))
    except TypeError:  # Pillow before 10.1: one size only
        font = ImageFont.load_default()
    width = max(2, scale // 200)
    if p.top:
        text = "\n".join(f"{t['name']} {t['score']:.2f}" for t in p.top)
        box = pen.multiline_textbbox((4, 4), text, font=font)
        pen.rectangle([box[0] - 3, box[1] - 3, box[2] + 3, box[3] + 3], fill="black")
        pen.multiline_text((4, 4), text, fill="white", font=font)
        return out
    for b in sorted(p.boxes, key=lambda b: b["score"]):  # the best drawn last, on top
        colour = PALETTE[b["class"] % len(PALETTE)]
        x0, y0, x1, y1 = b["box"]
        pen.rectangle([x0, y0, x1, y1], outline=colour, width=width)
        label = f"{b['name']} {b['score']:.2f}"
        tb = pen.textbbox((0, 0), label, font=font)
        th, tw = tb[3] - tb[1], tb[2] - tb[0]
        ty = y0 - th - 4 if y0 - th - 4 >= 0 else y0
        pen.rectangle([x0, ty, x0 + tw + 4, ty + th + 4], fill=colour)
        pen.text((x0 + 2, ty + 2 - tb[1]), label, fill="white", font=font)
    return out
