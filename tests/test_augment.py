"""Augmentation from a cfg's options: darknet's meanings and defaults, boxes that follow the
pixels, draws that depend on the sample and the step alone, and plans that still give the
local answer with it on."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.plan import Plan, Stage
from swarm.data import make_batch, open_datasets, step_indices, training_batch
from swarm.data.augment import Augment, Augmenter
from swarm.errors import SwarmError
from swarm.local.trainer import LocalTrainer
from tests.test_execution import _cfg, _local, _planned, _worst

CFG = Path(__file__).resolve().parent / "cfg" / "darknet"


def _read(text: str) -> Augment:
    return Augment.from_cfg(text, "t.cfg")


DETECTOR = "[net]\nwidth=64\nheight=64\n{net}\n[convolutional]\nfilters=30\nsize=1\nactivation=linear\n" \
           "[yolo]\nmask=0,1,2\nanchors=10,14, 23,27, 37,58\nclasses=5\nnum=3\n{head}\n"
CLASSIFIER = "[net]\nwidth=32\nheight=32\n{net}\n[convolutional]\nfilters=5\nsize=1\nactivation=linear\n" \
             "[avgpool]\n[softmax]\n"


def test_a_cfg_that_says_nothing_gets_darknets_defaults():
    assert _read(DETECTOR.format(net="", head="")) == Augment(jitter=0.2, flip=True)
    assert _read(CLASSIFIER.format(net="")) == Augment(flip=True)


def test_a_cfgs_options_mean_what_they_mean_in_darknet():
    det = _read(DETECTOR.format(net="hue=.1\nsaturation=1.5\nexposure=1.5\nflip=0\nangle=7\nmosaic=1",
                                head="jitter=.3"))
    assert det == Augment(jitter=0.3, hue=0.1, saturation=1.5, exposure=1.5, flip=False, mosaic=True)  # no angle
    assert det.describe() == "jitter=0.3, hue=0.1, saturation=1.5, exposure=1.5, mosaic=1"
    cls = _read(CLASSIFIER.format(net="angle=7\nmosaic=1\njitter=.1"))
    assert cls == Augment(jitter=0.1, flip=True, angle=7.0)  # a classifier has no mosaic
    assert _read(DETECTOR.format(net="flip=0", head="jitter=0")) == Augment()
    assert not Augment().active and Augment().describe() == "none"


def test_a_bad_value_is_refused_with_file_and_line():
    with pytest.raises(SwarmError, match=r"t\.cfg:1 \[net\]: 'hue=lots' is not a number"):
        _read(DETECTOR.format(net="hue=lots", head=""))


class Boxes:
    """White rectangles on black, each image's boxes its rectangles (class 0..)."""

    def __init__(self, size=(96, 64)):
        self.w, self.h = size
        rng = np.random.default_rng(3)
        self.items = []
        for _ in range(6):  # edges on whole pixels, so that the labels are exact
            x0, y0 = int(rng.integers(2, self.w // 2)), int(rng.integers(2, self.h // 2))
            x1, y1 = int(rng.integers(x0 + 12, self.w - 2)), int(rng.integers(y0 + 10, self.h - 2))
            self.items.append(np.array([[1, (x0 + x1) / 2 / self.w, (y0 + y1) / 2 / self.h,
                                         (x1 - x0) / self.w, (y1 - y0) / self.h]], np.float32))

    def __len__(self):
        return len(self.items)

    def load(self, index):
        img = np.zeros((3, self.h, self.w), np.uint8)
        _, cx, cy, bw, bh = self.items[index][0]
        x0, x1 = round((cx - bw / 2) * self.w), round((cx + bw / 2) * self.w)
        y0, y1 = round((cy - bh / 2) * self.h), round((cy + bh / 2) * self.h)
        img[:, y0:y1, x0:x1] = 255
        return img, self.items[index].copy()


def _bright_box(img: np.ndarray) -> tuple[float, float, float, float]:
    ys, xs = np.nonzero(img[0] > 190)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


@pytest.mark.parametrize("step", range(6))
def test_a_jittered_and_flipped_box_stays_on_its_object(step):
    data = Boxes()
    maker = Augmenter(Augment(jitter=0.3, flip=True), seed=1, classify=False)
    for index in range(len(data)):
        img, boxes = maker.sample(data, index, step)
        assert img.shape == (3, 64, 96) and img.dtype == np.uint8
        if not len(boxes):  # cropped away: then nothing bright is left either
            assert (img[0] > 190).sum() < 4 * 96
            continue
        _, cx, cy, bw, bh = boxes[0]
        x0, y0, x1, y1 = _bright_box(img)
        assert abs((cx - bw / 2) * 96 - x0) <= 1.5 and abs((cx + bw / 2) * 96 - x1) <= 1.5, (index, boxes, x0, x1)
        assert abs((cy - bh / 2) * 64 - y0) <= 1.5 and abs((cy + bh / 2) * 64 - y1) <= 1.5, (index, boxes, y0, y1)


def test_a_flip_alone_mirrors_pixels_and_boxes():
    data = Boxes()
    maker = Augmenter(Augment(flip=True), seed=0, classify=False)
    flipped = 0
    for step in range(8):
        img, boxes = maker.sample(data, 0, step)
        original, truth = data.load(0)
        if np.array_equal(img, original):
            assert np.allclose(boxes, truth)
        else:
            flipped += 1
            assert np.array_equal(img, original[:, :, ::-1])
            assert np.isclose(boxes[0, 1], 1 - truth[0, 1])
    assert 0 < flipped < 8


def test_recolouring_keeps_grey_grey_and_moves_colours():
    data = Boxes()
    maker = Augmenter(Augment(hue=0.1, saturation=1.5, exposure=1.5), seed=0, classify=False)
    img, boxes = maker.sample(data, 2, 0)
    assert np.allclose(boxes, data.load(2)[1])
    assert (img[0] == img[1]).all() and (img[1] == img[2]).all()  # white and black have no hue
    shapes, _ = open_datasets(None, 64, 3)
    before, _ = shapes.load(5)
    after = [maker.sample(shapes, 5, s)[0] for s in range(3)]
    assert all(not np.array_equal(a, before) for a in after)
    assert not np.array_equal(after[0], after[1])


def test_a_mosaic_puts_four_augmented_images_around_a_centre():
    shapes, _ = open_datasets(None, 96, 3)
    maker = Augmenter(Augment(jitter=0.2, flip=True, mosaic=True), seed=2, classify=False)
    mosaics = 0
    for step in range(10):
        img, boxes = maker.sample(shapes, 7, step)
        plain, _ = Augmenter(Augment(jitter=0.2, flip=True), seed=2, classify=False).sample(shapes, 7, step)
        mosaics += not np.array_equal(img, plain)
        assert img.shape == (3, 96, 96)
        assert ((boxes[:, 1:3] >= 0) & (boxes[:, 1:3] <= 1)).all() and (boxes[:, 3:] * 96 >= 2 - 1e-4).all()
    assert 2 <= mosaics <= 8  # about half


def test_a_sample_is_augmented_alike_in_any_batch_on_any_device():
    shapes, _ = open_datasets(None, 64, 3)
    maker = Augmenter(Augment(jitter=0.3, hue=0.1, saturation=1.5, exposure=1.5, flip=True, mosaic=True),
                      seed=4, classify=False)
    a_img, a_box = make_batch(shapes, [3, 9, 11], maker, step=6)
    b_img, b_box = make_batch(shapes, [11, 3], Augmenter(maker.aug, 4, False), step=6)
    assert np.array_equal(a_img[0], b_img[1]) and np.array_equal(a_img[2], b_img[0])
    n = int((a_box[0, :, 0] >= 0).sum())
    assert np.array_equal(a_box[0, :n], b_box[1, :n])
    c_img, _ = make_batch(shapes, [3], maker, step=7)
    d_img, _ = make_batch(shapes, [3], Augmenter(maker.aug, 5, False), step=6)
    assert not np.array_equal(a_img[0], c_img[0]) and not np.array_equal(a_img[0], d_img[0])


def test_a_classifier_keeps_its_label_whatever_the_crop():
    data = Boxes()
    maker = Augmenter(Augment(jitter=0.6, flip=True, angle=20), seed=0, classify=True)
    for step in range(10):
        _, boxes = maker.sample(data, 1, step)
        assert len(boxes) == 1 and boxes[0, 0] == 1


def _mosaic_cfg(tmp_path: Path) -> str:
    text = (CFG / "yolov4-tiny.cfg").read_text().replace("[net]\n", "[net]\nmosaic=1\n", 1)
    path = tmp_path / "yolov4-tiny-mosaic.cfg"
    path.write_text(text)
    return str(path)


def test_training_sees_augmented_samples_and_augment_off_does_not(tmp_path):
    """The plans' tests (test_execution, test_graph_plans, ...) train with the cfgs' own
    augmentation on both sides; here, that it is on, and that --augment off turns it off."""
    model = _mosaic_cfg(tmp_path)
    on = LocalTrainer(_cfg(model, 2))
    off = LocalTrainer(_cfg(model, 2, augment=False))
    assert on.augment == Augment(jitter=0.3, hue=0.1, saturation=1.5, exposure=1.5, flip=True, mosaic=True)
    assert off.augmenter is None
    data, _ = open_datasets(None, 64, 3)
    assert not np.array_equal(training_batch(on, data, 0)[0], training_batch(off, data, 0)[0])
    assert np.array_equal(training_batch(off, data, 0)[0], make_batch(data, step_indices(len(data), 8, 0, 7))[0])


def test_a_plan_with_mosaic_and_every_option_equals_local(tmp_path):
    """A dp group sharing each micro-batch unevenly (every plan kind trains augmented against
    local in tests/test_execution.py and tests/test_graph_plans.py, with the cfgs' options)."""
    model = _mosaic_cfg(tmp_path)
    cfg = _cfg(model, 2)
    stages = [Stage(0, 38, "dp", ["d0", "d1", "d2"], allocation={"d0": 2, "d1": 1, "d2": 1})]
    trainer = _planned(cfg, Plan(model, 64, 8, 2, stages))
    worst, key = _worst(trainer.net.state_dict(), _local(cfg))
    assert worst < 1e-9, (key, worst)
