"""Reading a classification data set laid out as one folder per class (torchvision's ImageFolder).

    DIR/train/CLASS/*.jpg  DIR/val/CLASS/*.jpg     (or valid/, validation/, test/)
    DIR/train/CLASS/*.jpg                          held-out split: every 10th image of each class

Class names are the folder names under train/, sorted (class k is the k-th), as ImageFolder
numbers them; a held-out folder may lack a class, not add one. Images that do not decode
whole are skipped and named, as in the YOLO folders (swarm.data.yolo_dir), with the same
cache of what decoding found. A sample is its image letterboxed into the input, with one
label row covering the whole image: (class, 0.5, 0.5, 1, 1), so a classifier's target (the
class of the largest object, swarm.data.class_targets) is the folder's class.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from planner.image_size import ImageSize
from swarm.data.yolo_dir import HELDOUT_EVERY, IMAGE_SUFFIXES, VAL_NAMES, DecodeCache, decode_all, image_to_input
from swarm.errors import SwarmError


def is_image_folder(root: Path) -> bool:
    """Whether `root` is laid out as train/CLASS/ folders of images (and not YOLO's train/images/)."""
    train = root / "train"
    if not train.is_dir() or (train / "images").is_dir() or (root / "images").is_dir():
        return False
    return any(sub.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in sub.iterdir())
               for sub in train.iterdir())


def folder_classes(root: Path) -> list[str]:
    """The class names: the folders under DIR/train, sorted."""
    return sorted(sub.name for sub in (root / "train").iterdir() if sub.is_dir() and not sub.name.startswith("."))


def _files(split: Path, classes: list[str]) -> list[tuple[Path, int]]:
    files = []
    for sub in sorted(p for p in split.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if sub.name not in classes:
            raise SwarmError(f"{sub} is a class that {split.parent / 'train'} does not have; every held-out class "
                             "needs a training folder of the same name")
        k = classes.index(sub.name)
        files += [(p, k) for p in sorted(sub.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    return files


class ImageFolderSplit:
    """One split of a class-per-folder data set, letterboxed into `img_size` (W x H) on load."""

    task = "classify"

    def __init__(self, root: Path, split: str, img_size: ImageSize, channels: int, samples: list[tuple[Path, int]],
                 classes: list[str], skipped: list[str]):
        self.root, self.split, self.img_size, self.channels = root, split, img_size, channels
        self.samples, self.classes, self.skipped = samples, classes, skipped
        self.name = f"{root} ({split})"

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        from PIL import Image

        path, k = self.samples[index]
        try:
            with Image.open(path) as im:
                arr, box = image_to_input(im, self.img_size, self.channels)
        except (OSError, ValueError, SyntaxError) as exc:
            raise SwarmError(f"{path}: cannot decode the image ({exc}); fix or remove it and run again") from None
        return arr, box.to_input(np.array([[k, 0.5, 0.5, 1.0, 1.0]], dtype=np.float32))


def open_image_folder(root: str | Path, img_size: ImageSize | int,
                      channels: int) -> tuple[ImageFolderSplit, ImageFolderSplit]:
    """(train, held-out) splits of the class-per-folder data set at `root`."""
    root, img_size = Path(root), ImageSize.of(img_size)
    classes = folder_classes(root)
    val = next((root / name for name in VAL_NAMES if (root / name).is_dir()), None)
    found = _files(root / "train", classes)
    held_files = _files(val, classes) if val is not None else []
    cache = DecodeCache(root)
    problems = decode_all([p for p, _ in found + held_files], cache)
    cache.save()
    skipped = [problems[p] for p, _ in found if problems[p]]
    usable = [(p, k) for p, k in found if not problems[p]]
    if val is None:  # every 10th image of each class, so that each class is held out alike
        seen: dict[int, int] = {}
        train, held = [], []
        for p, k in usable:
            seen[k] = seen.get(k, 0) + 1
            (held if seen[k] % HELDOUT_EVERY == 0 else train).append((p, k))
        skipped_val: list[str] = []
    else:
        train = usable
        held = [(p, k) for p, k in held_files if not problems[p]]
        skipped_val = [problems[p] for p, _ in held_files if problems[p]]
    if not train:
        detail = f"; first problem: {skipped[0]}" if skipped else ""
        raise SwarmError(f"no usable training images in {root / 'train'}{detail}")
    return (ImageFolderSplit(root, "train", img_size, channels, train, classes, skipped),
            ImageFolderSplit(root, "heldout", img_size, channels, held, classes, skipped_val))
