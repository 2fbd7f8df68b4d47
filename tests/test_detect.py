"""`swarm detect`: a checkpoint's predictions on image files equal the network's on the same
images as training reads them; drawn copies, YOLO-format text and JSON; classifiers' top-k."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from swarm.data.shapes import SyntheticShapes
from planner.image_size import ImageSize
from swarm.data.yolo_dir import Letterbox, open_yolo_directory
from swarm.local.checkpoint import load_checkpoint
from swarm.local.detect import Detector
from tests.conftest import run_swarm


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Four shape images as files (one 4:3, one grey), and a YOLO folder of the same images."""
    root = tmp_path_factory.mktemp("photos")
    data = SyntheticShapes("heldout", 200, 3)
    for i in range(4):
        arr, boxes = data.load(i)
        im = Image.fromarray(arr.transpose(1, 2, 0))
        im = im.resize((320, 240)) if i == 1 else im.convert("L") if i == 2 else im
        (root / "images").mkdir(exist_ok=True)
        (root / "labels").mkdir(exist_ok=True)
        im.save(root / "images" / f"p{i}.png")
        (root / "labels" / f"p{i}.txt").write_text("".join(f"{int(b[0])} {b[1]} {b[2]} {b[3]} {b[4]}\n" for b in boxes))
    return root


@pytest.fixture(scope="module")
def detector_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "yolo.pt"
    r = run_swarm("train", "--model", "yolov2-tiny", "--img-size", "96", "--steps", "3", "--batch-size", "4",
                  "--seed", "2", "--no-eval", "--save", path, "--threads", "1")
    assert r.returncode == 0, r.stderr
    return path


def test_boxes_are_the_networks_on_what_training_reads(photos, detector_checkpoint, tmp_path):
    """The same images through the training data path (YoloDirectory.load) and through
    detect give the same boxes, mapped back from the letterboxed input to each image's own
    pixels (the 4:3 one sits between grey bands)."""
    out = tmp_path / "out"
    r = run_swarm("detect", "--checkpoint", detector_checkpoint, photos / "images", "--out", out, "--conf", "0.01",
                  "--json", "--batch-size", "3")
    assert r.returncode == 0, r.stderr
    found = {Rec["image"].split("/")[-1]: Rec for Rec in json.loads(r.stdout)}
    detector = Detector(load_checkpoint(detector_checkpoint), conf=0.01)
    train, held = open_yolo_directory(photos, 96, 3)
    split = {p.name: (ds, k) for ds in (train, held) for k, (p, _) in enumerate(ds.samples)}
    total = 0
    for name, rec in found.items():
        ds, k = split[name]
        x, _ = ds.load(k)
        with torch.no_grad():
            (det,) = detector.loss.detections(detector.net(torch.from_numpy(x[None])), 0.01, 0.45)
        assert len(rec["boxes"]) == len(det), name
        total += len(det)
        letterbox = Letterbox((rec["width"], rec["height"]), ImageSize(96, 96))
        for box, row in zip(rec["boxes"], det.tolist()):
            assert box["class"] == int(row[0]) and box["score"] == pytest.approx(row[1], abs=1e-4)
            cx, cy, w, h = letterbox.to_image(*row[2:])
            assert [box["cx"], box["cy"], box["w"], box["h"]] == pytest.approx([cx, cy, w, h], abs=1e-6)
            x0 = (cx - w / 2) * rec["width"]
            assert box["box"][0] == pytest.approx(x0, abs=0.06)
        lines = (out / name.replace(".png", ".txt")).read_text().splitlines()
        assert len(lines) == len(det) and all(len(line.split()) == 6 for line in lines)
        with Image.open(out / name.replace(".png", ".jpg")) as drawn:
            assert drawn.size == (rec["width"], rec["height"])
    assert total > 0  # a comparison of nothing would prove nothing
    assert {rec["width"] for rec in found.values()} == {200, 320}


def test_classifier_top_k(tmp_path, photos):
    ck = tmp_path / "lenet.pt"
    r = run_swarm("train", "--model", "lenet5", "--steps", "2", "--batch-size", "4", "--no-eval", "--save", ck,
                  "--threads", "1")
    assert r.returncode == 0, r.stderr
    r = run_swarm("detect", "--checkpoint", ck, photos / "images" / "p0.png", "--top-k", "3", "--json", "--out",
                  tmp_path / "out")
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(r.stdout)
    detector = Detector(load_checkpoint(ck))
    with Image.open(photos / "images" / "p0.png") as im:
        x = torch.from_numpy(np.stack([np.asarray(im.convert("L").resize((32, 32), Image.BILINEAR))[None]]))  # square
    with torch.no_grad():
        probs = torch.softmax(detector.net(x).flatten(1).double(), 1)[0]
    best = probs.topk(3)
    assert [t["class"] for t in rec["top"]] == best.indices.tolist()
    assert [t["score"] for t in rec["top"]] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert [t["name"] for t in rec["top"]][0] in ("disc", "box", "triangle", "cross", "ring")
    assert len((tmp_path / "out" / "p0.txt").read_text().splitlines()) == 3


def test_unreadable_images_are_skipped_and_mistakes_are_one_line(photos, detector_checkpoint, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes((photos / "images" / "p0.png").read_bytes()[:300])
    r = run_swarm("detect", "--checkpoint", detector_checkpoint, broken, photos / "images" / "p3.png", "--out",
                  tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert f"skipped {broken}: cannot decode the image" in r.stderr and "1 skipped" in r.stderr
    for bad, says in [([tmp_path / "nothing.png"], "no such file or folder"),
                      ([broken], "no image could be decoded"),
                      ([photos / "images", "--conf", "2"], "--conf: must be between 0 and 1, got 2.0")]:
        r = run_swarm("detect", "--checkpoint", detector_checkpoint, *bad, "--out", tmp_path / "out2")
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
