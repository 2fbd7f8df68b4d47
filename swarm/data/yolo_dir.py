"""Reading a detection data set in the YOLO directory format.

Accepted layouts (labels are `class cx cy w h` per line, relative to the image):

    DIR/images/*.jpg  DIR/labels/*.txt                     held-out split: every 10th image
    DIR/train/images  DIR/train/labels  DIR/val/images ... (or valid/)
    DIR/images/train  DIR/labels/train  DIR/images/val ... (or valid/)

Class names come from DIR/classes.txt or a DIR/*.names file when there is one.
Samples that cannot be used (no label file, a malformed line, an image that does not decode
whole: unreadable or truncated) are skipped, and the loader says how many and which. Every
image is decoded once at the scan, in parallel, and what that found is cached by path, size
and modification time (DecodeCache), so a second run does not pay it again.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planner.image_size import ImageSize
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


def decode_problem(path: Path) -> str | None:
    """Why the image at `path` cannot be used, or None: it is decoded whole (a truncated JPEG
    passes a header check and fails only here)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return f"{path}: not a readable image ({exc})"
    return None


class DecodeCache:
    """What decoding each image found, kept by path, size and modification time in the state
    directory, so that a second scan of the same files does not decode them again."""

    def __init__(self, root: Path):
        import hashlib

        from swarm.host.state import default_state_dir

        key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        self.path = default_state_dir() / "scans" / f"{key}.json"
        try:
            self.known = json.loads(self.path.read_text())
            if not isinstance(self.known, dict):
                self.known = {}
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    @staticmethod
    def stamp(path: Path) -> str:
        st = path.stat()
        return f"{st.st_size}:{st.st_mtime_ns}"

    def get(self, path: Path) -> tuple[bool, str | None]:
        """(whether it is known, its problem)."""
        entry = self.known.get(str(path))
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == self.stamp(path):
            return True, entry[1]
        return False, None

    def put(self, path: Path, problem: str | None) -> None:
        self.known[str(path)] = [self.stamp(path), problem]
        self.changed = True

    def save(self) -> None:
        """Written beside and renamed into place; a cache that cannot be written is no cache."""
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_suffix(f".{os.getpid()}.part")
            part.write_text(json.dumps(self.known))
            os.replace(part, self.path)
        except OSError:
            pass


def decode_all(files: list[Path], cache: DecodeCache | None) -> dict[Path, str | None]:
    """Each image's problem (None: it decodes), decoding those the cache does not know in
    parallel threads (the codecs let go of the interpreter while they work)."""
    from concurrent.futures import ThreadPoolExecutor

    from swarm.host.resources import usable_cores

    problems, todo = {}, []
    for path in files:
        known, problem = cache.get(path) if cache else (False, None)
        if known:
            problems[path] = problem
        else:
            todo.append(path)
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(8, usable_cores()))) as pool:
            for path, problem in zip(todo, pool.map(decode_problem, todo)):
                problems[path] = problem
                if cache:
                    cache.put(path, problem)
    return problems


def _scan(images: Path, labels: Path, cache: DecodeCache | None = None) -> Scan:
    if not images.is_dir():
        raise SwarmError(f"image folder {images} does not exist")
    files = sorted(p for p in images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SwarmError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {images}")
    scan = Scan()
    labelled = []
    for img in files:
        label = labels / (img.stem + ".txt")
        if not label.is_file():
            scan.skipped.append(f"{img}: no label file {label}")
            continue
        try:
            labelled.append((img, parse_label_file(label)))
        except SwarmError as exc:
            scan.skipped.append(str(exc))
    problems = decode_all([img for img, _ in labelled], cache)
    for img, boxes in labelled:
        if problems[img]:
            scan.skipped.append(problems[img])
        else:
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


@dataclass(frozen=True)
class Letterbox:
    """Where a photo lands in the network's input: scaled by one factor to fit inside it (its
    aspect ratio kept), centred, the rest grey. Maps boxes (cx, cy, w, h, relative) between
    the photo and the input; a photo of the input's own shape fills it."""

    image: tuple[int, int]  # the photo's (width, height)
    size: ImageSize  # the input's

    @property
    def placed(self) -> tuple[int, int, int, int]:
        """(left, top, width, height) of the scaled photo inside the input, in pixels."""
        (w0, h0), (width, height) = self.image, (self.size.width, self.size.height)
        scale = min(width / w0, height / h0)
        nw, nh = min(width, max(1, round(w0 * scale))), min(height, max(1, round(h0 * scale)))
        return (width - nw) // 2, (height - nh) // 2, nw, nh

    def to_input(self, boxes: np.ndarray) -> np.ndarray:
        """Label rows (class, cx, cy, w, h) relative to the photo -> relative to the input."""
        x0, y0, nw, nh = self.placed
        width, height = self.size.width, self.size.height
        out = boxes.copy()
        out[:, 1] = (x0 + boxes[:, 1] * nw) / width
        out[:, 2] = (y0 + boxes[:, 2] * nh) / height
        out[:, 3] = boxes[:, 3] * nw / width
        out[:, 4] = boxes[:, 4] * nh / height
        return out

    def to_image(self, cx: float, cy: float, w: float, h: float) -> tuple[float, float, float, float]:
        """A box (cx, cy, w, h) relative to the input -> relative to the photo."""
        x0, y0, nw, nh = self.placed
        width, height = self.size.width, self.size.height
        return (cx * width - x0) / nw, (cy * height - y0) / nh, w * width / nw, h * height / nh


PAD_GREY = 127  # the letterbox's border, darknet's 0.5


def image_to_input(im, img_size: ImageSize, channels: int) -> tuple[np.ndarray, Letterbox]:
    """A PIL image as the network takes it, (C, H, W) uint8: converted to RGB (or grey for one
    channel), letterboxed into the input's W x H (scaled with bilinear filtering to fit, its
    aspect ratio kept, centred on grey); and the Letterbox that maps boxes to and from it.
    The one rule for training, evaluation and `swarm detect`."""
    from PIL import Image

    im = im.convert("L" if channels == 1 else "RGB")
    box = Letterbox((im.width, im.height), img_size)
    x0, y0, nw, nh = box.placed
    arr = np.asarray(im.resize((nw, nh), Image.BILINEAR), dtype=np.uint8)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    if (nw, nh) == (img_size.width, img_size.height):
        return np.ascontiguousarray(arr), box
    out = np.full((arr.shape[0], img_size.height, img_size.width), PAD_GREY, dtype=np.uint8)
    out[:, y0:y0 + nh, x0:x0 + nw] = arr
    return out, box


class YoloDirectory:
    """One split of a YOLO-format data set, letterboxed into `img_size` (W x H) on load."""

    def __init__(self, root: Path, split: str, img_size: ImageSize, channels: int, samples, classes: list[str], skipped: list[str]):
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
                arr, box = image_to_input(im, self.img_size, self.channels)
        except (OSError, ValueError, SyntaxError) as exc:
            raise SwarmError(f"{path}: cannot decode the image ({exc}); fix or remove it and run again") from None
        return arr, box.to_input(boxes)


def data_folder(root: str | Path) -> Path:
    """`--data` as a folder that is there; a SwarmError if not."""
    root = Path(root)
    if not root.exists():
        raise SwarmError(f"data folder {root} does not exist")
    if not root.is_dir():
        raise SwarmError(f"--data {root} is not a folder")
    return root


def open_yolo_directory(root: str | Path, img_size: ImageSize | int, channels: int) -> tuple[YoloDirectory, YoloDirectory]:
    """(train, held-out) splits of the data set at `root`, letterboxed into `img_size` (an int is a square)."""
    root, img_size = data_folder(root), ImageSize.of(img_size)
    (train_img, train_lab), val = _split_dirs(root)
    cache = DecodeCache(root)
    scan = _scan(train_img, train_lab, cache)
    if val is None:
        held = [s for i, s in enumerate(scan.samples) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
        train = [s for i, s in enumerate(scan.samples) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
        skipped_val: list[str] = []
    else:
        vscan = _scan(*val, cache)
        train, held, skipped_val = scan.samples, vscan.samples, vscan.skipped
    cache.save()
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
