"""Classifiers on one folder of images per class (DIR/train/CLASS/*.jpg, torchvision's ImageFolder
layout): written by `swarm data sample --task classify`, read with the folders' class names,
unreadable images skipped and named, trained on and evaluated."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from swarm.data import class_targets, data_class_names, make_batch, open_datasets
from swarm.errors import SwarmError
from tests.conftest import run_swarm


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "shapes"
    r = run_swarm("data", "sample", root, "--task", "classify", "--count", "40", "--width", "48", "--height", "40")
    assert r.returncode == 0, r.stderr
    assert f"--data {root}" in r.stdout
    return root


def test_a_class_per_folder_set_reads_back_with_the_folders_classes(folder):
    classes = sorted(p.name for p in (folder / "train").iterdir())
    assert set(classes) <= {"disc", "box", "triangle", "cross", "ring"} and len(classes) >= 3
    train, held = open_datasets(str(folder), 32, 3)
    assert train.classes == classes == data_class_names(folder)
    files = sum(len(list((folder / s).rglob("*.jpg"))) for s in ("train", "val"))
    assert len(train) + len(held) == files == 40 and train.skipped == held.skipped == []
    images, targets = make_batch(train, range(len(train)))
    assert images.shape == (len(train), 3, 32, 32) and images.dtype == np.uint8
    # each image's target is the folder it is in
    expect = [classes.index(path.parent.name) for path, _ in train.samples]
    assert class_targets(targets).tolist() == expect


def test_without_a_val_folder_every_tenth_image_of_each_class_is_held_out(folder):
    for path in (folder / "val").rglob("*.jpg"):
        path.unlink()
    for sub in (folder / "val").iterdir():
        sub.rmdir()
    (folder / "val").rmdir()
    train, held = open_datasets(str(folder), 32, 3)
    per_class = {}
    for _, k in train.samples + held.samples:
        per_class[k] = per_class.get(k, 0) + 1
    assert len(held) == sum(n // 10 for n in per_class.values())


def test_unreadable_images_are_skipped_and_named_and_unknown_classes_refused(folder):
    some = next(p for p in (folder / "train").iterdir())
    (some / "broken.jpg").write_bytes(b"not a picture")
    good = next(some.glob("train*.jpg"))
    with Image.open(good) as im:
        im.save(some / "cut.jpg", quality=90)
    (some / "cut.jpg").write_bytes((some / "cut.jpg").read_bytes()[:200])  # truncated
    train, _ = open_datasets(str(folder), 32, 3)
    assert sorted(p.split(":")[0].rsplit("/", 1)[1] for p in train.skipped) == ["broken.jpg", "cut.jpg"]
    (folder / "val" / "zebra").mkdir()
    with pytest.raises(SwarmError, match="zebra is a class that .* does not have"):
        open_datasets(str(folder), 32, 3)


def test_a_classifier_trains_on_the_folders_and_a_detector_is_refused_in_one_line(folder, tmp_path):
    r = run_swarm("train", "--model", "lenet5", "--data", folder, "--batch-size", "4", "--steps", "2",
                  "--threads", "1", "--save", tmp_path / "c.pt")
    assert r.returncode == 0, r.stderr
    assert "top-1 accuracy" in r.stdout
    bad = run_swarm("train", "--model", "yolov3-tiny", "--data", folder, "--steps", "1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "one folder of images per class" in bad.stderr.strip().splitlines()[-1]
