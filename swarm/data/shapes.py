"""A built-in detection data set: procedurally drawn shapes with their boxes.

Each image is drawn from its own random stream (data seed, split, index), in coordinates
relative to the image, so any sample can be made on any device, at any size, and is always
the same scene.
"""
from __future__ import annotations

import numpy as np

from planner.image_size import ImageSize

CLASSES = ("disc", "box", "triangle", "cross", "ring")
SPLITS = {"train": (0, 10000), "heldout": (1, 200)}  # split -> (stream id, number of images)
DATA_SEED = 20261121  # the data set is fixed; --seed changes the order of samples, not the images


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    i = int(h * 6) % 6
    f = h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    return np.array([(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i], dtype=np.float32)


def _overlap(a, b) -> float:
    ax1, ay1, ax2, ay2 = a[0] - a[2] / 2, a[1] - a[3] / 2, a[0] + a[2] / 2, a[1] + a[3] / 2
    bx1, by1, bx2, by2 = b[0] - b[2] / 2, b[1] - b[3] / 2, b[0] + b[2] / 2, b[1] + b[3] / 2
    iw, ih = max(0.0, min(ax2, bx2) - max(ax1, bx1)), max(0.0, min(ay2, by2) - max(ay1, by1))
    inter = iw * ih
    return inter / (a[2] * a[3] + b[2] * b[3] - inter)


def _inside(cls: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mask of a shape in box-relative coordinates x, y in [-1, 1] (y grows downwards)."""
    if cls == 0:  # disc
        return x * x + y * y <= 1.0
    if cls == 1:  # box
        return (np.abs(x) <= 1.0) & (np.abs(y) <= 1.0)
    if cls == 2:  # triangle, apex up
        return (y <= 1.0) & (np.abs(x) <= (y + 1.0) / 2.0)
    if cls == 3:  # cross
        return ((np.abs(x) <= 0.3) & (np.abs(y) <= 1.0)) | ((np.abs(y) <= 0.3) & (np.abs(x) <= 1.0))
    r2 = x * x + y * y  # ring
    return (r2 <= 1.0) & (r2 >= 0.45)


class SyntheticShapes:
    """Images of 1-4 coloured shapes on a noisy gradient; labels (class, cx, cy, w, h)."""

    classes = CLASSES

    def __init__(self, split: str, img_size: ImageSize | int, channels: int = 3, size: int | None = None):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        self.stream, default_len = SPLITS[split]
        self.split = split
        self.img_size = ImageSize.of(img_size)
        self.channels = channels
        self.length = default_len if size is None else size
        self.name = f"synthetic shapes ({split})"

    @property
    def num_classes(self) -> int:
        return len(CLASSES)

    def __len__(self) -> int:
        return self.length

    def scene(self, index: int) -> list[tuple[int, float, float, float, float, np.ndarray]]:
        """The objects of image `index`: (class, cx, cy, w, h, rgb) in relative units."""
        rng = np.random.default_rng([DATA_SEED, self.stream, index])
        objects = []
        for _ in range(int(rng.integers(1, 5))):
            for _attempt in range(20):
                side = rng.uniform(0.12, 0.5)
                aspect = float(np.exp(rng.uniform(-0.5, 0.5)))
                w, h = min(0.95, side * np.sqrt(aspect)), min(0.95, side / np.sqrt(aspect))
                cx, cy = rng.uniform(w / 2, 1 - w / 2), rng.uniform(h / 2, 1 - h / 2)
                box = (cx, cy, w, h)
                if all(_overlap(box, o[1:5]) < 0.15 for o in objects):
                    cls = int(rng.integers(0, len(CLASSES)))
                    rgb = _hsv_to_rgb(rng.uniform(), rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0))
                    objects.append((cls, cx, cy, w, h, rgb))
                    break
        return objects

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(image uint8 (C, H, W), boxes float32 (n, 5))."""
        if not 0 <= index < self.length:
            raise IndexError(index)
        height, width = self.img_size.hw
        rng = np.random.default_rng([DATA_SEED, self.stream, index, 1])
        objects = self.scene(index)
        # background: a dim two-colour gradient plus noise
        c0 = rng.uniform(0.0, 0.45, size=3).astype(np.float32)
        c1 = rng.uniform(0.0, 0.45, size=3).astype(np.float32)
        angle = rng.uniform(0, 2 * np.pi)
        across = (np.arange(width, dtype=np.float32) + 0.5) / width  # pixel centres, relative
        down = (np.arange(height, dtype=np.float32) + 0.5) / height
        ramp = np.cos(angle) * across[None, :] + np.sin(angle) * down[:, None]
        ramp = (ramp - ramp.min()) / max(float(ramp.max() - ramp.min()), 1e-6)
        img = c0[:, None, None] + (c1 - c0)[:, None, None] * ramp[None]
        img += rng.normal(0.0, 0.04, size=(3, height, width)).astype(np.float32)
        boxes = []
        for cls, cx, cy, w, h, rgb in objects:
            x0, x1 = max(0, int(np.floor((cx - w / 2) * width))), min(width, int(np.ceil((cx + w / 2) * width)))
            y0, y1 = max(0, int(np.floor((cy - h / 2) * height))), min(height, int(np.ceil((cy + h / 2) * height)))
            xs = (across[x0:x1] - cx) / (w / 2)
            ys = (down[y0:y1] - cy) / (h / 2)
            mask = _inside(cls, xs[None, :], ys[:, None])
            shade = rgb[:, None, None] * (0.85 + 0.15 * rng.uniform())
            region = img[:, y0:y1, x0:x1]
            region[:, mask] = np.broadcast_to(shade, region.shape)[:, mask]
            boxes.append((cls, cx, cy, w, h))
        img = np.clip(img * 255.0 + 0.5, 0, 255).astype(np.uint8)
        if self.channels == 1:
            grey = (0.299 * img[0] + 0.587 * img[1] + 0.114 * img[2] + 0.5).astype(np.uint8)
            img = grey[None]
        elif self.channels != 3:
            raise ValueError(f"synthetic images have 1 or 3 channels, not {self.channels}")
        return img, np.array(boxes, dtype=np.float32).reshape(-1, 5)
