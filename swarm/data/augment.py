"""Augmentation as darknet's cfg asks for it, drawn from the sample and the step alone.

    aug = Augment.from_cfg(cfg_text, "yolov4-tiny.cfg")       # [net] and head options
    maker = Augmenter(aug, seed=1, classify=False)
    image, boxes = maker.sample(dataset, index=17, step=40)   # the same on every device

The options keep darknet's meanings and defaults:

- `jitter` (a [yolo]/[region]/[detection] head's option, or [net]'s; darknet's default 0.2 for a
  detector's head, none for a classifier): each side of the crop moves in or out by up to this
  fraction of the image, and the crop is stretched back to the input (darknet without
  letter_box does the same); the rest is grey.
- `flip` ([net], default 1): a mirror image left to right, half of the time.
- `hue` (a shift by up to this fraction of the colour circle), `saturation` and `exposure`
  (scaled by a factor between 1/s and s, as darknet's rand_scale draws it), on the HSV image.
- `angle` ([net], degrees): a rotation by up to this much, for classifiers only (darknet rotates
  classification samples only; a rotated box is no longer a box).
- `mosaic` ([net], detectors only): half of the samples become four images, each augmented on
  its own, put together around a random centre; a box cut by a seam keeps its part when at
  least a fifth of it and two pixels each way remain.

Everything random is drawn from a generator seeded by (run seed, step, sample index), never
from where or in what order the sample is made, so every plan (dp shares, pipelines, a replay
after a failure) sees the very pixels local training sees. Held-out data is never augmented.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from swarm.data.yolo_dir import PAD_GREY

AUGMENT_STREAM = 0xA06  # keeps augmentation's draws apart from any other use of the seed
DETECTOR_HEADS = ("yolo", "region", "detection")
MOSAIC_DRAW = 5  # the draw of whether a sample is a mosaic (0: the sample's own, 1-4: a mosaic's pieces)
MIN_PIXELS = 2  # a box narrower or lower than this after a crop is dropped
MIN_KEPT = 0.2  # ... and one of which less than this share is left inside a mosaic's piece


@dataclass(frozen=True)
class Augment:
    jitter: float = 0.0
    hue: float = 0.0
    saturation: float = 1.0
    exposure: float = 1.0
    flip: bool = False
    angle: float = 0.0
    mosaic: bool = False

    @property
    def active(self) -> bool:
        return self != Augment()

    def describe(self) -> str:
        """The options in effect, as a cfg would write them ("none" when there are none)."""
        default = Augment()
        shown = [f"{k}={int(v) if isinstance(v, bool) else v:g}" for k, v in asdict(self).items()
                 if v != getattr(default, k)]
        return ", ".join(shown) or "none"

    @classmethod
    def from_sections(cls, sections) -> "Augment":
        """darknet's reading of a parsed cfg: [net]'s options, and a head's jitter."""
        net = next((s for s in sections if s.name == "net"), None)
        heads = [s for s in sections if s.name in DETECTOR_HEADS]

        def num(sec, key, default):
            return default if sec is None or key not in sec.options else sec.get_float(key)

        if heads:  # darknet's data loader takes the heads' jitter ([net]'s where no head sets one)
            given = [num(h, "jitter", 0.2) for h in heads if "jitter" in h.options]
            jitter = max(given) if given else num(net, "jitter", 0.2)
        else:
            jitter = num(net, "jitter", 0.0)
        return cls(jitter=min(max(jitter, 0.0), 0.9), hue=min(abs(num(net, "hue", 0.0)), 0.5),
                   saturation=max(num(net, "saturation", 1.0), 1e-3), exposure=max(num(net, "exposure", 1.0), 1e-3),
                   flip=bool(num(net, "flip", 1.0)), angle=0.0 if heads else abs(num(net, "angle", 0.0)),
                   mosaic=bool(heads) and bool(num(net, "mosaic", 0.0)))

    @classmethod
    def from_cfg(cls, cfg_text: str, source: str) -> "Augment":
        from swarm.zoo.darknet import parse_cfg

        return cls.from_sections(parse_cfg(cfg_text, source))


def _scale(rng: np.random.Generator, s: float) -> float:
    """darknet's rand_scale: a factor between 1 and s, inverted half of the time."""
    f = rng.uniform(1.0, s) if s >= 1 else rng.uniform(s, 1.0)
    return f if rng.random() < 0.5 else 1.0 / f


def _pil(img: np.ndarray):
    from PIL import Image

    return Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))


def _array(im) -> np.ndarray:
    arr = np.asarray(im, dtype=np.uint8)
    return np.ascontiguousarray(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))


def _fill(im):
    return PAD_GREY if im.mode == "L" else (PAD_GREY,) * 3


def crop(im, boxes: np.ndarray, window: tuple[float, float, float, float], keep_all: bool):
    """The part `window` (x0, y0, x1, y1, in pixels, may reach outside) of the PIL image `im`
    stretched to the whole image, grey where it is outside; boxes (class, cx, cy, w, h,
    relative) moved with it and clipped to it (those left too small dropped unless `keep_all`)."""
    from PIL import Image

    width, height = im.size
    x0, y0, x1, y1 = window
    out_im = im.transform((width, height), Image.EXTENT, (x0, y0, x1, y1), Image.BILINEAR, fillcolor=_fill(im))
    sx, sy = width / (x1 - x0), height / (y1 - y0)
    out = boxes.copy()
    if len(boxes):
        left = ((boxes[:, 1] - boxes[:, 3] / 2) * width - x0) * sx
        right = ((boxes[:, 1] + boxes[:, 3] / 2) * width - x0) * sx
        top = ((boxes[:, 2] - boxes[:, 4] / 2) * height - y0) * sy
        bottom = ((boxes[:, 2] + boxes[:, 4] / 2) * height - y0) * sy
        out = clip_boxes(boxes[:, 0], left, top, right, bottom, width, height, keep_all)
    return out_im, out


def clip_boxes(cls, left, top, right, bottom, width: int, height: int, keep_all: bool,
               region: tuple[float, float, float, float] | None = None) -> np.ndarray:
    """Boxes given by pixel edges, clipped to `region` (x0, y0, x1, y1; the whole image by
    default), as rows (class, cx, cy, w, h) relative to the image."""
    rx0, ry0, rx1, ry1 = region or (0, 0, width, height)
    l, t = np.clip(left, rx0, rx1), np.clip(top, ry0, ry1)
    r, b = np.clip(right, rx0, rx1), np.clip(bottom, ry0, ry1)
    kept = (r - l) * (b - t) / np.maximum((right - left) * (bottom - top), 1e-9)
    keep = np.ones(len(l), bool) if keep_all else (r - l >= MIN_PIXELS) & (b - t >= MIN_PIXELS) & (kept >= MIN_KEPT)
    out = np.stack([cls, (l + r) / 2 / width, (t + b) / 2 / height, (r - l) / width, (b - t) / height], axis=1)
    if keep_all:
        out[:, 3:] = np.maximum(out[:, 3:], 1e-6)
    return out[keep].astype(np.float32).reshape(-1, 5)


def _table(factor: float) -> list[int]:
    return np.clip(np.arange(256) * factor + 0.5, 0, 255).astype(np.uint8).tolist()


def recolour(im, rng: np.random.Generator, aug: Augment):
    """The PIL image with its hue turned, saturation and exposure scaled (one of one channel:
    exposure only), by per-channel tables over its HSV form."""
    dhue = rng.uniform(-aug.hue, aug.hue) if aug.hue else 0.0
    dsat = _scale(rng, aug.saturation) if aug.saturation != 1 else 1.0
    dexp = _scale(rng, aug.exposure) if aug.exposure != 1 else 1.0
    if dhue == 0 and dsat == 1 and dexp == 1:
        return im
    if im.mode == "L":
        return im.point(_table(dexp))
    turn = ((np.arange(256) + int(round(dhue * 256))) % 256).tolist()
    return im.convert("HSV").point(turn + _table(dsat) + _table(dexp)).convert("RGB")


class Augmenter:
    """Makes the augmented form of training samples: `sample(dataset, index, step)`."""

    def __init__(self, aug: Augment, seed: int, classify: bool):
        self.aug, self.seed, self.classify = aug, seed, classify

    def rng(self, index: int, step: int, part: int = 0) -> np.random.Generator:
        return np.random.default_rng([AUGMENT_STREAM, self.seed, step, index, part])

    def one(self, img: np.ndarray, boxes: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One image's crop jitter, flip, rotation and colour."""
        from PIL import Image

        aug, (_, height, width) = self.aug, img.shape
        im = _pil(img)
        if aug.jitter:
            dl, dt, dr, db = rng.uniform(-aug.jitter, aug.jitter, size=4)
            im, boxes = crop(im, boxes, (dl * width, dt * height, width - dr * width, height - db * height),
                             keep_all=self.classify)
        if aug.flip and rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
            boxes = boxes.copy()
            boxes[:, 1] = 1.0 - boxes[:, 1]
        if aug.angle and self.classify:
            im = im.rotate(rng.uniform(-aug.angle, aug.angle), Image.BILINEAR, fillcolor=_fill(im))
        return _array(recolour(im, rng, aug)), boxes

    def sample(self, dataset, index: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = self.rng(index, step)
        img, boxes = dataset.load(index)
        if not (self.aug.mosaic and not self.classify and self.rng(index, step, MOSAIC_DRAW).random() < 0.5):
            return self.one(img, boxes, rng)
        _, height, width = img.shape
        cx, cy = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height
        others = rng.integers(0, len(dataset), size=3)
        canvas = np.empty_like(img)
        pieces = []
        quads = [(0, 0, cx, cy), (cx, 0, width, cy), (0, cy, cx, height), (cx, cy, width, height)]
        for k, (quad, source) in enumerate(zip(quads, [index, *map(int, others)])):
            part, part_boxes = self.one(*(dataset.load(source) if k else (img, boxes)), self.rng(index, step, k + 1))
            x0, y0, x1, y1 = (int(round(v)) for v in quad)
            canvas[:, y0:y1, x0:x1] = part[:, y0:y1, x0:x1]
            if len(part_boxes):
                b = part_boxes
                left, right = (b[:, 1] - b[:, 3] / 2) * width, (b[:, 1] + b[:, 3] / 2) * width
                top, bottom = (b[:, 2] - b[:, 4] / 2) * height, (b[:, 2] + b[:, 4] / 2) * height
                pieces.append(clip_boxes(b[:, 0], left, top, right, bottom, width, height, False, (x0, y0, x1, y1)))
        return canvas, (np.concatenate(pieces) if pieces else np.zeros((0, 5), np.float32))
