"""Reading a detection data set in the YOLO directory format.

Accepted layouts (labels are `class cx cy w h` per line, relative to the image):

    DIR/images/*.jpg  DIR/labels/*.txt                     held-out split: every 10th image
    DIR/train/images  DIR/train/labels  DIR/val/images ... (or valid/)
    DIR/images/train  DIR/labels/train  DIR/images/val ... (or valid/)

Class names come from DIR/classes.txt or a DIR/*.names file when there is one.
Samples that cannot be used (no label file, a malformed line, an unreadable image) are
skipped, and the loader says how many and which.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from swarm.errors import SwarmError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
VAL_NAMES = ("val", "valid", "validation", "test")
HELDOUT_EVERY = 10


@dataclass
class Scan:
    """What a scan of one split found: usable samples, and why others were skipped."""

    samples: list[tuple[Path, np.ndarray]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _split_dirs(root: Path) -> tuple[tuple[Path, Path], tuple[Path, Path] | None]:
    """(train images, train labels), (held-out images, labels) or None to hold out every 10th."""
    if (root / "images").is_dir() and (root / "labels").is_dir():
        for val in VAL_NAMES:
            if (root / "images" / "train").is_dir() and (root / "images" / val).is_dir():
                return ((root / "images" / "train", root / "labels" / "train"),
                        (root / "images" / val, root / "labels" / val))
        return (root / "images", root / "labels"), None
    if (root / "train" / "images").is_dir():
        for val in VAL_NAMES:
            if (root / val / "images").is_dir():
                return ((root / "train" / "images", root / "train" / "labels"),
                        (root / val / "images", root / val / "labels"))
        return (root / "train" / "images", root / "train" / "labels"), None
    raise SwarmError(
        f"{root} is not a YOLO data set: expected {root}/images and {root}/labels "
        f"(or train/ and val/ folders with images/ and labels/ in each)")


def parse_label_file(path: Path) -> np.ndarray:
    """Rows (class, cx, cy, w, h); raises SwarmError naming the file and line."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SwarmError(f"{path}: cannot read ({exc})") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 5:
            raise SwarmError(f"{path}:{lineno}: expected 5 values 'class cx cy w h', got {len(parts)}")
        try:
            cls = int(parts[0])
            cx, cy, w, h = (float(v) for v in parts[1:])
        except ValueError:
            raise SwarmError(f"{path}:{lineno}: '{line.strip()}' is not 'class cx cy w h' numbers") from None
        if cls < 0:
            raise SwarmError(f"{path}:{lineno}: class {cls} is negative")
        if not all(math.isfinite(v) for v in (cx, cy, w, h)) or not (0 <= cx <= 1 and 0 <= cy <= 1 and 0 < w <= 1 and 0 < h <= 1):
            raise SwarmError(f"{path}:{lineno}: box '{line.strip()}' is not relative to the image (values in [0, 1], w, h > 0)")
        rows.append((cls, cx, cy, w, h))
    return np.array(rows, dtype=np.float32).reshape(-1, 5)


def _scan(images: Path, labels: Path) -> Scan:
    from PIL import Image, UnidentifiedImageError

    if not images.is_dir():
        raise SwarmError(f"image folder {images} does not exist")
    files = sorted(p for p in images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SwarmError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {images}")
    scan = Scan()
    for img in files:
        label = labels / (img.stem + ".txt")
        if not label.is_file():
            scan.skipped.append(f"{img}: no label file {label}")
            continue
        try:
            boxes = parse_label_file(label)
        except SwarmError as exc:
            scan.skipped.append(str(exc))
            continue
        try:
            with Image.open(img) as im:
                im.verify()
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
            scan.skipped.append(f"{img}: not a readable image ({exc})")
            continue
        scan.samples.append((img, boxes))
    return scan


def class_names(root: Path) -> list[str] | None:
    candidates = [root / "classes.txt", root / "obj.names"] + sorted(root.glob("*.names"))
    for path in candidates:
        if path.is_file():
            names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
            if names:
                return names
    return None


def image_to_input(im, img_size: int, channels: int) -> np.ndarray:
    """A PIL image as the network takes it, (C, img_size, img_size) uint8: converted to RGB
    (or grey for one channel) and resized to the square with bilinear filtering, without
    keeping its aspect ratio (boxes stay relative to the image, so they carry over). The one
    rule for training, evaluation and `swarm detect`."""
    from PIL import Image

    im = im.convert("L" if channels == 1 else "RGB")
    im = im.resize((img_size, img_size), Image.BILINEAR)
    arr = np.asarray(im, dtype=np.uint8)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr)


class YoloDirectory:
    """One split of a YOLO-format data set, resized to `img_size` squares on load."""

    def __init__(self, root: Path, split: str, img_size: int, channels: int, samples, classes: list[str], skipped: list[str]):
        self.root = root
        self.split = split
        self.img_size = img_size
        self.channels = channels
        self.samples = samples
        self.classes = classes
        self.skipped = skipped
        self.name = f"{root} ({split})"

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        from PIL import Image

        path, boxes = self.samples[index]
        try:
            with Image.open(path) as im:
                arr = image_to_input(im, self.img_size, self.channels)
        except (OSError, ValueError, SyntaxError) as exc:
            raise SwarmError(f"{path}: cannot decode the image ({exc}); fix or remove it and run again") from None
        return arr, boxes


def open_yolo_directory(root: str | Path, img_size: int, channels: int) -> tuple[YoloDirectory, YoloDirectory]:
    """(train, held-out) splits of the data set at `root`."""
    root = Path(root)
    if not root.exists():
        raise SwarmError(f"data folder {root} does not exist")
    if not root.is_dir():
        raise SwarmError(f"--data {root} is not a folder")
    (train_img, train_lab), val = _split_dirs(root)
    scan = _scan(train_img, train_lab)
    if val is None:
        held = [s for i, s in enumerate(scan.samples) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
        train = [s for i, s in enumerate(scan.samples) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
        skipped_val: list[str] = []
    else:
        vscan = _scan(*val)
        train, held, skipped_val = scan.samples, vscan.samples, vscan.skipped
    if not train:
        detail = f"; first problem: {scan.skipped[0]}" if scan.skipped else ""
        raise SwarmError(f"no usable training samples in {root}{detail}")
    names = class_names(root)
    max_cls = max((int(b[:, 0].max()) for _, b in train + held if len(b)), default=-1)
    if names is None:
        names = [str(i) for i in range(max_cls + 1)] or ["0"]
    elif max_cls >= len(names):
        raise SwarmError(f"{root}: labels use class {max_cls}, but the class names file lists only {len(names)} classes")
    return (YoloDirectory(root, "train", img_size, channels, train, names, scan.skipped),
            YoloDirectory(root, "heldout", img_size, channels, held, names, skipped_val))
