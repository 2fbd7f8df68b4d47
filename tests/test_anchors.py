"""Anchors fitted to the data (`swarm data anchors`, `swarm train --anchors auto`): k-means with
IoU finds the clusters boxes were drawn from, the fitted anchors go to the anchors the [yolo]
masks use, and those a run was trained with come back in eval, detect and export."""
from __future__ import annotations

import numpy as np
import pytest

from swarm.cli import main
from swarm.local.checkpoint import load_checkpoint, load_network
from swarm.zoo import describe_model, model_source
from swarm.zoo.anchors import (box_sizes, cfg_with_anchors, fit_anchors, fitted_anchors, learned_iou, mean_best_iou,
                               shape_iou)
from swarm.zoo.darknet import parse_cfg
from tests.conftest import run_swarm

CLUSTERS = np.array([(12.0, 40.0), (30.0, 30.0), (70.0, 25.0), (60.0, 90.0), (150.0, 120.0)])


def _drawn(seed: int = 1, per: int = 200, spread: float = 0.08) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([c * np.exp(rng.normal(0.0, spread, size=(per, 2))) for c in CLUSTERS])


def test_kmeans_with_iou_recovers_the_clusters_boxes_were_drawn_from():
    anchors, iou = fit_anchors(_drawn(), len(CLUSTERS))
    by_area = CLUSTERS[np.argsort(CLUSTERS.prod(1))]
    assert anchors.shape == (5, 2)
    assert np.all(np.diff(anchors.prod(1)) > 0)  # sorted by area, as darknet prints them
    assert np.allclose(anchors, by_area, rtol=0.05), anchors
    assert iou > 0.85 and iou > mean_best_iou(_drawn(), by_area * 1.3)
    again, _ = fit_anchors(_drawn(), len(CLUSTERS))
    assert np.array_equal(anchors, again)  # deterministic


def test_fitting_refuses_too_few_boxes_in_a_line():
    from swarm.errors import SwarmError

    with pytest.raises(SwarmError, match="at least 3 boxes of different sizes"):
        fit_anchors(np.array([(10.0, 10.0), (10.0, 10.0), (20.0, 5.0)]), 3)
    with pytest.raises(SwarmError, match="no boxes"):
        fit_anchors(np.zeros((0, 2)), 3)


def test_the_fitted_anchors_fill_the_slots_the_masks_use_and_the_cfg_states_them_at_its_own_size():
    """yolov4-tiny's masks are 3,4,5 and 1,2,3: anchor 0 is in no mask (a box that took it as its
    best would be learnt by no head), so it keeps its value and the five clusters go to 1-5; the
    .cfg writes anchors at [net]'s 416 px, the network trains at 256."""
    desc = describe_model("yolov4-tiny", 256, 5)
    wh = _drawn()
    anchors, before, after = fitted_anchors(desc, wh)
    old = desc.extra["heads"][0]["anchors"]
    assert anchors[0] == pytest.approx(old[0])
    assert np.allclose(sorted(anchors[1:], key=lambda a: a[0] * a[1]), CLUSTERS[np.argsort(CLUSTERS.prod(1))],
                       rtol=0.05)
    assert after > 0.85 > before
    assert learned_iou(wh, anchors, [1, 2, 3, 4, 5]) == pytest.approx(after)
    assert shape_iou(wh, np.array(anchors)).argmax(1).min() >= 1  # no box goes to the anchor no head learns

    _, text, source = model_source("yolov4-tiny")
    fitted = cfg_with_anchors(text, source, desc, anchors)
    yolo = [s for s in parse_cfg(fitted, source) if s.name == "yolo"]
    assert len(yolo) == 2 and all(np.allclose(np.array(s.get_floats("anchors")).reshape(-1, 2),
                                              np.array(anchors) * 416 / 256, rtol=1e-5) for s in yolo)
    again = describe_model("yolov4-tiny", 256, 5, cfg_text=fitted)
    for head in again.extra["heads"]:
        assert np.allclose(head["anchors"], anchors, rtol=1e-5)
    assert fitted.count("\n") == text.count("\n") + (0 if text.endswith("\n") else 1)  # lines replaced, not added


def test_box_sizes_are_the_letterboxed_boxes_in_input_pixels(tmp_path):
    from swarm.data import open_datasets
    from swarm.data.shapes import SyntheticShapes

    root = tmp_path / "s"
    assert main(["data", "sample", str(root), "--count", "10", "--width", "128", "--height", "64"]) == 0
    train, _ = open_datasets(str(root), 64, 3)  # 128 x 64 photos: scaled by half, in a 64 x 32 band
    wh = box_sizes(train)
    labels = np.concatenate([b for _, b in train.samples])
    assert np.allclose(wh, labels[:, 3:5] * [64, 32], atol=1e-4)
    shapes = SyntheticShapes("train", 96, 3, size=5)
    drawn = np.concatenate([[(w * 96, h * 96) for _, _, _, w, h, _ in shapes.scene(i)] for i in range(5)])
    assert np.allclose(box_sizes(shapes), drawn)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchors") / "s"
    assert main(["data", "sample", str(root), "--count", "30", "--width", "96", "--height", "96"]) == 0
    return root


def test_data_anchors_prints_darknets_line(sample, capsys):
    assert main(["data", "anchors", str(sample), "--model", "yolov3-tiny", "--img-size", "64"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("anchors="))
    values = [int(v) for v in line[len("anchors="):].replace(" ", "").split(",")]
    assert len(values) == 12 and all(v >= 1 for v in values)
    assert "mean IoU of a box with its anchor" in out


@pytest.mark.parametrize("flags, says", [
    (["--model", "yolov2-16"], "has a [region] head"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_data_anchors_bad_model_is_one_line(sample, flags, says):
    r = run_swarm("data", "anchors", sample, *flags)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_data_anchors_without_boxes_is_one_line(tmp_path):
    root = tmp_path / "empty"
    assert main(["data", "sample", str(root), "--count", "10", "--width", "64", "--height", "64"]) == 0
    for label in root.glob("*/labels/*.txt"):
        label.write_text("")
    r = run_swarm("data", "anchors", root, "--model", "yolov4-tiny")
    assert r.returncode != 0 and "no boxes" in r.stderr and "Traceback" not in r.stderr
    r = run_swarm("train", "--model", "yolov4-tiny", "--img-size", "64", "--data", root, "--anchors", "auto",
                  "--steps", "1", "--batch-size", "2", "--strategy", "local", "--save", tmp_path / "x.pt")
    assert r.returncode != 0 and "no boxes" in r.stderr and "Traceback" not in r.stderr


def test_train_anchors_auto_on_a_model_without_yolo_heads_is_one_line(sample, tmp_path):
    r = run_swarm("train", "--model", "yolov2-16", "--img-size", "32", "--data", sample, "--anchors", "auto",
                  "--steps", "1", "--batch-size", "2", "--strategy", "local", "--save", tmp_path / "x.pt")
    assert r.returncode != 0 and "[region] head" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_anchors_a_run_fitted_come_back_in_eval_detect_and_export(sample, tmp_path, capsys):
    save = tmp_path / "run.pt"
    assert main(["train", "--model", "yolov4-tiny", "--img-size", "64", "--data", str(sample), "--anchors", "auto",
                 "--steps", "2", "--batch-size", "2", "--strategy", "local", "--threads", "1", "--no-eval",
                 "--save", str(save)]) == 0
    capsys.readouterr()
    from swarm.data import open_datasets

    desc0 = describe_model("yolov4-tiny", 64, 5)
    train_set, _ = open_datasets(str(sample), desc0.img_size, 3)
    expected, _, _ = fitted_anchors(desc0, box_sizes(train_set))
    assert expected != desc0.extra["heads"][0]["anchors"]

    state = load_checkpoint(save)
    assert state["config"]["anchors"] == "auto"
    _, desc, _ = load_network(state, str(save))  # what eval, detect and export build
    for head in desc.extra["heads"]:
        assert np.allclose(head["anchors"], expected, rtol=1e-5)

    assert main(["eval", "--checkpoint", str(save), "--data", str(sample), "--threads", "1"]) == 0
    assert "mAP" in capsys.readouterr().out
    image = next((sample / "val" / "images").iterdir())
    assert main(["detect", "--checkpoint", str(save), str(image), "--out", str(tmp_path / "det"), "--threads", "1"]) == 0
    assert (tmp_path / "det" / (image.stem + ".txt")).exists()

    assert main(["export", "--checkpoint", str(save), "--format", "darknet", "--out", str(tmp_path / "out"),
                 "--threads", "1"]) == 0
    written = (tmp_path / "out.cfg").read_text()
    yolo = [s for s in parse_cfg(written, "out.cfg") if s.name == "yolo"]
    assert len(yolo) == 2
    for s in yolo:  # written at the exported [net] size, 64: the anchors the run trained with
        assert np.allclose(np.array(s.get_floats("anchors")).reshape(-1, 2), expected, rtol=1e-4)

    # a resumed run keeps them and refuses to change them
    assert main(["train", "--resume", str(save), "--steps", "3", "--strategy", "local", "--threads", "1",
                 "--no-eval"]) == 0
    assert load_checkpoint(save)["cfg"] == state["cfg"]
    r = run_swarm("train", "--resume", save, "--anchors", "cfg", "--steps", "4", "--strategy", "local")
    assert r.returncode != 0 and "keeps the anchors it started with" in r.stderr and "Traceback" not in r.stderr
