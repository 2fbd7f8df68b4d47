"""Data sets, the seeded order of samples, and turning samples into batches.

    train, heldout = open_datasets(None, img_size=128, channels=3)   # built-in shapes
    idx = step_indices(len(train), batch_size=16, step=5, seed=1)
    images, targets = make_batch(train, idx)   # uint8 (B, C, H, W), float32 (B, N, 5)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from planner.image_size import ImageSize
from swarm.data.image_folder import folder_classes, is_image_folder, open_image_folder
from swarm.data.shapes import SyntheticShapes
from swarm.data.yolo_dir import class_names, open_yolo_directory
from swarm.errors import SwarmError


def open_datasets(data: str | None, img_size: ImageSize | int, channels: int):
    """(train, held-out) for `--data` (None: the built-in synthetic shapes; a folder in the
    YOLO layout, or one folder of images per class) at `img_size` (W x H; an int is a square)."""
    img_size = ImageSize.of(img_size)
    if data is None or data == "synthetic":
        return SyntheticShapes("train", img_size, channels), SyntheticShapes("heldout", img_size, channels)
    if Path(data).is_dir() and is_image_folder(Path(data)):
        return open_image_folder(data, img_size, channels)
    return open_yolo_directory(data, img_size, channels)


def default_classes(model: str, img_size: ImageSize | int | None = None) -> int | None:
    """The head's classes when none are given, as `swarm train` picks them: a built-in
    model gets the built-in data's classes; a .cfg file keeps its own."""
    from swarm.zoo import BUILTIN, describe_model

    if model not in BUILTIN:
        return None
    desc = describe_model(model, img_size)
    return open_datasets(None, desc.img_size, desc.in_channels)[0].num_classes


def data_class_names(root: Path) -> list[str] | None:
    """The class names of the data set at `root`: a class-per-folder set's folder names, a YOLO
    set's names file (None: it has none)."""
    return folder_classes(root) if is_image_folder(root) else class_names(root)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Whole mini-batches in one pass over `n` samples (the last partial batch is dropped)."""
    if batch_size > n:
        raise SwarmError(f"--batch-size {batch_size} is larger than the data set ({n} samples)")
    return n // batch_size


def step_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """The sample indices of mini-batch `step`: a fresh seeded permutation every epoch."""
    per_epoch = steps_per_epoch(n, batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * batch_size:(k + 1) * batch_size]


def sample_keys(step: int, positions) -> list[int]:
    """One integer per sample of a step, the same on every device (draws dropout masks)."""
    return [step * (1 << 20) + int(p) for p in positions]


def microbatch_bounds(batch_size: int, microbatches: int) -> list[tuple[int, int]]:
    """Split a mini-batch into `microbatches` consecutive ranges, sizes differing by at most 1."""
    if not 1 <= microbatches <= batch_size:
        raise SwarmError(f"--microbatches must be between 1 and the batch size ({batch_size}), got {microbatches}")
    base, extra = divmod(batch_size, microbatches)
    bounds, start = [], 0
    for m in range(microbatches):
        size = base + (1 if m < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def make_batch(dataset, indices, augmenter=None, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Images (B, C, S, S) uint8 and boxes (B, N, 5) float32, padded with class -1; with an
    `augmenter` (swarm.data.augment), each sample as augmented for `step`."""
    if augmenter is not None:
        images, boxes = zip(*(augmenter.sample(dataset, int(i), step) for i in indices))
    else:
        images, boxes = zip(*(dataset.load(int(i)) for i in indices))
    most = max(max(len(b) for b in boxes), 1)
    targets = np.full((len(indices), most, 5), -1.0, dtype=np.float32)
    for k, b in enumerate(boxes):
        targets[k, :len(b)] = b
    return np.stack(images), targets


def training_batch(trainer, dataset, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The mini-batch of `step` as `trainer` (swarm.local.trainer.LocalTrainer) trains on it:
    its seeded samples, augmented as its config says."""
    cfg = trainer.cfg
    return make_batch(dataset, step_indices(len(dataset), cfg.batch_size, step, cfg.seed), trainer.augmenter, step)


def class_targets(targets: np.ndarray) -> np.ndarray:
    """For classifiers: the class of the largest object in each image."""
    area = np.where(targets[..., 0] >= 0, targets[..., 3] * targets[..., 4], -1.0)
    best = area.argmax(axis=1)
    return targets[np.arange(len(targets)), best, 0].astype(np.int64)
