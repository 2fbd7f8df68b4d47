"""Data sets: the synthetic shapes, the YOLO folder loader and its complaints, sample order."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from swarm.data import (class_targets, make_batch, microbatch_bounds, open_datasets, step_indices,
                        steps_per_epoch)
from swarm.data.shapes import SyntheticShapes
from swarm.errors import SwarmError


def test_synthetic_is_deterministic_and_size_independent():
    a = SyntheticShapes("train", 64)
    b = SyntheticShapes("train", 64)
    big = SyntheticShapes("train", 160)
    for i in range(5):
        ia, ba = a.load(i)
        ib, bb = b.load(i)
        assert np.array_equal(ia, ib) and np.array_equal(ba, bb)
        assert np.array_equal(ba, big.load(i)[1])  # the same scene at any size
        assert ia.shape == (3, 64, 64) and ia.dtype == np.uint8
        assert 1 <= len(ba) <= 4
        assert np.all((ba[:, 1:] > 0) & (ba[:, 1:] <= 1)) and np.all(ba[:, 0] < 5)


def test_synthetic_splits_differ_and_objects_are_drawn():
    train, held = SyntheticShapes("train", 64), SyntheticShapes("heldout", 64)
    assert not np.array_equal(train.load(0)[0], held.load(0)[0])
    img, boxes = train.load(3)
    cls, cx, cy, w, h = boxes[0]
    x, y = int(cx * 64), int(cy * 64)
    if int(cls) != 4 and int(cls) != 3:  # the centre of a ring or cross may be background
        assert img[:, y, x].max() > 120  # shapes are bright, the background dim


def test_grey_images():
    img, _ = SyntheticShapes("train", 32, channels=1).load(0)
    assert img.shape == (1, 32, 32)


def test_step_indices_are_seeded_permutations():
    n, bsz = 50, 8
    per = steps_per_epoch(n, bsz)
    epoch0 = np.concatenate([step_indices(n, bsz, s, seed=1) for s in range(per)])
    assert len(set(epoch0.tolist())) == per * bsz  # no repeats inside an epoch
    assert np.array_equal(step_indices(n, bsz, 2, seed=1), step_indices(n, bsz, 2, seed=1))
    assert not np.array_equal(step_indices(n, bsz, 0, seed=1), step_indices(n, bsz, 0, seed=2))
    assert not np.array_equal(step_indices(n, bsz, 0, seed=1), step_indices(n, bsz, per, seed=1))
    with pytest.raises(SwarmError, match="larger than the data set"):
        steps_per_epoch(5, 8)


def test_microbatch_bounds():
    assert microbatch_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert microbatch_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(SwarmError):
        microbatch_bounds(4, 5)


def test_make_batch_pads_and_class_targets():
    ds = SyntheticShapes("train", 32)
    images, targets = make_batch(ds, [0, 1, 2])
    assert images.shape == (3, 3, 32, 32) and images.dtype == np.uint8
    assert targets.shape[0] == 3 and targets.shape[2] == 5
    cls = class_targets(targets)
    for k in range(3):
        valid = targets[k][targets[k, :, 0] >= 0]
        assert cls[k] == valid[np.argmax(valid[:, 3] * valid[:, 4]), 0]


def _write_yolo(root, n=12, size=(40, 30)):
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        arr = rng.integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(arr).save(root / "images" / f"img{i:02d}.png")
        (root / "labels" / f"img{i:02d}.txt").write_text(f"{i % 3} 0.5 0.5 0.25 0.5\n1 0.2 0.3 0.1 0.1\n")


def test_yolo_folder(tmp_path):
    _write_yolo(tmp_path)
    (tmp_path / "classes.txt").write_text("a\nb\nc\n")
    train, held = open_datasets(str(tmp_path), 32, 3)
    assert len(train) + len(held) == 12 and len(held) == 1
    assert train.classes == ["a", "b", "c"]
    img, boxes = train.load(0)
    assert img.shape == (3, 32, 32) and boxes.shape == (2, 5)


def test_yolo_train_val_layout(tmp_path):
    _write_yolo(tmp_path / "train", n=4)
    _write_yolo(tmp_path / "val", n=2)
    train, held = open_datasets(str(tmp_path), 32, 1)
    assert (len(train), len(held)) == (4, 2)
    assert train.load(0)[0].shape == (1, 32, 32)
    assert train.num_classes == 3


def test_yolo_bad_samples_are_skipped_and_named(tmp_path):
    _write_yolo(tmp_path)
    (tmp_path / "labels" / "img00.txt").unlink()
    (tmp_path / "labels" / "img01.txt").write_text("0 0.5 0.5 0.2\n")
    (tmp_path / "labels" / "img02.txt").write_text("0 0.5 0.5 1.5 0.2\n")
    (tmp_path / "images" / "img03.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    train, held = open_datasets(str(tmp_path), 32, 3)
    assert len(train) + len(held) == 8
    text = "\n".join(train.skipped)
    assert "img00.png: no label file" in text
    assert "img01.txt:1: expected 5 values" in text
    assert "img02.txt:1: box" in text
    assert "img03.png: not a readable image" in text


@pytest.mark.parametrize("setup,message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "is not a YOLO data set"),
    (lambda p: ((p / "images").mkdir(parents=True), (p / "labels").mkdir()), "no images"),
    (lambda p: p.write_text("x"), "is not a folder"),
])
def test_yolo_folder_errors(tmp_path, setup, message):
    root = tmp_path / "data"
    setup(root)
    with pytest.raises(SwarmError, match=message):
        open_datasets(str(root), 32, 3)


def test_truncated_images_are_skipped_at_the_scan_which_is_cached(tmp_path, monkeypatch):
    """A JPEG cut short passes a header check but not a whole decode: the scan decodes every
    image, skips it and names it; a second scan of unchanged files decodes nothing, and a
    file that changed is decoded again."""
    from swarm.data import yolo_dir

    monkeypatch.setenv("SWARM_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "data"
    _write_yolo(root, n=4, size=(400, 300))
    path = root / "images" / "img00.jpg"
    Image.fromarray(np.zeros((300, 400, 3), np.uint8) + 100).save(path, quality=95)
    (root / "labels" / "img00.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 3])
    with Image.open(path) as im:
        im.verify()  # what a header check sees: nothing wrong
    decoded = []
    real = yolo_dir.decode_problem
    monkeypatch.setattr(yolo_dir, "decode_problem", lambda p: decoded.append(p.name) or real(p))
    train, held = open_datasets(str(root), 32, 3)
    assert len(decoded) == 5 and len(train) + len(held) == 4
    assert any("img00.jpg: not a readable image" in s for s in train.skipped)
    decoded.clear()
    open_datasets(str(root), 32, 3)
    assert decoded == []
    path.write_bytes(whole)  # mended: decoded again, and used
    decoded.clear()
    train, held = open_datasets(str(root), 32, 3)
    assert decoded == ["img00.jpg"] and len(train) + len(held) == 5
