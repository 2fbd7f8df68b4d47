"""Non-square inputs (--img-size WxH): the size and its forms, the zoo's rectangular maps and grid,
letterboxing, the region loss with its axes swapped, plans, and the command line end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from planner.image_size import ImageSize
from planner.plan import Plan, Stage
from swarm.data.shapes import SyntheticShapes
from swarm.data.yolo_dir import Letterbox, image_to_input
from swarm.errors import SwarmError
from swarm.local.checkpoint import load_checkpoint
from swarm.zoo import describe_model
from swarm.zoo.loss import RegionLoss
from tests.conftest import run_swarm

WIDE = ImageSize(64, 32)


# ---- the size ---------------------------------------------------------------------------------
def test_forms_of_a_size():
    assert ImageSize.parse("608x352") == ImageSize(608, 352) and ImageSize.parse("608X352").hw == (352, 608)
    assert ImageSize.parse("416") == ImageSize(416, 416)
    assert ImageSize(608, 352).to_json() == "608x352" and ImageSize(128, 128).to_json() == 128  # as before
    for size in (ImageSize(608, 352), ImageSize(128, 128)):
        assert ImageSize.of(size.to_json()) == size
        assert ImageSize.of(json.loads(json.dumps(size.to_json()))) == size
    assert ImageSize.of({"width": 64, "height": 32}) == WIDE  # dataclasses.asdict's form
    assert ImageSize.of([64, 32]) == WIDE and ImageSize.of(WIDE) is WIDE


@pytest.mark.parametrize("text,message", [
    ("608x", "is not a size"), ("x352", "is not a size"), ("608x352x3", "is not a size"), ("60.5", "is not a size"),
    ("-16", "is not a size"), ("", "is not a size"), ("0x352", "at least 1, got 0x352"),
])
def test_text_that_is_not_a_size(text, message):
    with pytest.raises(ValueError, match=message):
        ImageSize.parse(text)


@pytest.mark.parametrize("size,message", [
    ("600x352", "cannot take --img-size 600x352: its width and height each take multiples of 16 from 16 to 2048"),
    ("5000x16", "cannot take --img-size 5000x16: its width and height each take multiples of 16 from 16 to 2048"),
    ("4096", "cannot take --img-size 4096: it takes multiples of 16 from 16 to 2048"),
])
def test_sizes_a_network_cannot_take(size, message):
    with pytest.raises(SwarmError, match=message):
        describe_model("yolov2-16", ImageSize.parse(size))


# ---- the zoo ------------------------------------------------------------------------------------
def test_maps_are_h_by_w_each_side_as_its_own_square():
    """Rows and columns go through the layers alike: a 64x32 network's maps have the rows of the
    32-square network's and the columns of the 64-square network's, and cost in proportion."""
    wide, tall, narrow = describe_model("yolov2-16", WIDE), describe_model("yolov2-16", 64), describe_model("yolov2-16", 32)
    for r, t, n in zip(wide.layers, tall.layers, narrow.layers):
        assert r.out_shape == (t.out_shape[0], n.out_shape[1], t.out_shape[2])
        assert r.in_shape == (t.in_shape[0], n.in_shape[1], t.in_shape[2])
        assert r.flops * t.out_shape[1] * t.out_shape[2] == t.flops * r.out_shape[1] * r.out_shape[2]
    assert wide.extra["grid"] == (2, 4) and wide.extra["stride"] == 16
    assert wide.input_bytes == 3 * 64 * 32 * 4 and wide.to_dict()["img_size"] == "64x32"


def test_the_network_takes_an_h_by_w_batch():
    from swarm.zoo import build_model

    net, desc, _ = build_model("yolov2-16", WIDE, classes=3, seed=0)
    with torch.no_grad():
        out = net(torch.rand(2, 3, 32, 64))
    assert out.shape == (2, 5 * 8, 2, 4)


def test_anchors_keep_their_shape_across_a_change_of_aspect():
    """Anchors scale by one factor, the larger side's (a photo shaped like the input fills it):
    64x32 gets the anchors of 64x64; a .cfg's own size leaves them as written."""
    assert describe_model("yolov2-16", WIDE).extra["anchors"] == describe_model("yolov2-16", 64).extra["anchors"]
    assert describe_model("yolov2-16", "32x64").extra["anchors"] == describe_model("yolov2-16", 64).extra["anchors"]


def test_a_cfg_s_own_width_and_height_are_its_default(tmp_path):
    from swarm.zoo import model_source

    text = model_source("yolov2-16")[1].replace("width=416", "width=96").replace("height=416", "height=64")
    assert "height=64" in text
    path = tmp_path / "wide.cfg"
    path.write_text(text)
    desc = describe_model(str(path))
    assert desc.img_size == ImageSize(96, 64) and desc.extra["grid"] == (4, 6)
    assert desc.extra["anchors"] == describe_model("yolov2-16", 416).extra["anchors"]  # written for this size


# ---- data -----------------------------------------------------------------------------------------
def test_shapes_are_drawn_at_w_by_h():
    wide, square = SyntheticShapes("train", WIDE), SyntheticShapes("train", 64)
    img, boxes = wide.load(3)
    assert img.shape == (3, 32, 64)
    assert np.array_equal(boxes, square.load(3)[1])  # the same scene, relative to the image
    cls, cx, cy, _, _ = boxes[0]
    if int(cls) not in (3, 4):  # the centre of a ring or cross may be background
        assert img[:, int(cy * 32), int(cx * 64)].max() > 120


def test_a_photo_is_letterboxed_and_its_boxes_follow():
    """A 120x90 photo with a white block into 64x32: scaled by 32/90, centred between grey
    bands; the block's label, mapped into the input, covers the block's pixels there, and maps
    back to itself."""
    photo = np.zeros((90, 120, 3), np.uint8)
    photo[18:54, 30:90] = 255  # x 30..90, y 18..54
    label = np.array([[1, 60 / 120, 36 / 90, 60 / 120, 36 / 90]], np.float32)
    arr, box = image_to_input(Image.fromarray(photo), WIDE, 3)
    assert arr.shape == (3, 32, 64)
    x0, y0, nw, nh = box.placed
    assert (nh, nw) == (32, 43) and (x0, y0) == (10, 0)
    assert (arr[:, :, :x0] == 127).all() and (arr[:, :, x0 + nw:] == 127).all()
    _, cx, cy, w, h = box.to_input(label)[0]
    cols = np.flatnonzero(arr[0].max(axis=0) > 200)
    rows = np.flatnonzero(arr[0].max(axis=1) > 200)
    assert abs(cols[0] - (cx - w / 2) * 64) <= 1 and abs(cols[-1] + 1 - (cx + w / 2) * 64) <= 1
    assert abs(rows[0] - (cy - h / 2) * 32) <= 1 and abs(rows[-1] + 1 - (cy + h / 2) * 32) <= 1
    assert np.allclose(box.to_image(cx, cy, w, h), label[0, 1:], atol=1e-6)
    square = Letterbox((200, 200), ImageSize(96, 96))
    assert square.placed == (0, 0, 96, 96)  # a photo of the input's own shape fills it, as a resize


# ---- the region loss on a rectangular grid ------------------------------------------------------
def test_region_loss_and_detections_on_a_rectangular_grid_are_the_transposed_ones():
    """A 2x5 grid and its transpose, with targets and anchors transposed alike, give the same loss,
    the transposed gradient and the transposed boxes: neither axis stands in for the other."""
    head = dict(describe_model("yolov2-16", WIDE, classes=3).extra, rescore=True)
    head["anchors"] = [(0.5, 1.5), (2.0, 0.7), (1.2, 1.2), (3.0, 2.0), (0.8, 2.5)]
    flipped = dict(head, anchors=[(h, w) for w, h in head["anchors"]])
    torch.manual_seed(4)
    out = torch.randn(2, 40, 2, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[[0, 0.15, 0.7, 0.2, 0.5], [2, 0.8, 0.3, 0.3, 0.2]],
                            [[1, 0.55, 0.4, 0.6, 0.3], [-1, 0, 0, 0, 0]]], dtype=torch.float64)
    swapped = targets[..., [0, 2, 1, 4, 3]]

    def transposed(t):  # (B, A*(5+C), H, W) -> (B, A*(5+C), W, H) with tx<->ty, tw<->th
        return t.view(2, 5, 8, 2, 5)[:, :, [1, 0, 3, 2, 4, 5, 6, 7]].transpose(3, 4).reshape(2, 40, 5, 2)

    loss = RegionLoss(head)(out, targets, 2)
    loss_t = RegionLoss(flipped)(transposed(out), swapped, 2)
    assert float(loss.detach()) == pytest.approx(float(loss_t.detach()), rel=1e-12) and float(loss.detach()) > 0
    (grad,) = torch.autograd.grad(loss, out)
    (grad_t,) = torch.autograd.grad(loss_t, out)
    assert torch.allclose(grad, grad_t, rtol=1e-10, atol=1e-14)
    dets = RegionLoss(head).detections(out.detach(), 0.05, 1.0)
    dets_t = RegionLoss(flipped).detections(transposed(out.detach()), 0.05, 1.0)
    for d, t in zip(dets, dets_t):
        assert len(d) > 0 and torch.allclose(d[:, [0, 1, 3, 2, 5, 4]], t, atol=1e-12)


def test_a_planted_box_decodes_to_its_cell_on_a_rectangular_grid():
    head = describe_model("yolov2-16", WIDE, classes=3).extra
    out = torch.full((1, 40, 2, 4), -20.0)
    out[0, 4, 1, 3] = 20.0  # anchor 0's objectness at row 1, column 3
    out[0, 0:4, 1, 3] = 0.0  # centre in the middle of the cell, the anchor's own size
    out[0, 5, 1, 3] = 20.0  # class 0
    (det,) = RegionLoss(head).detections(out)
    (c, score, cx, cy, w, h) = det[0].tolist()
    aw, ah = head["anchors"][0]
    assert c == 0 and score > 0.99
    assert (cx, cy) == pytest.approx((3.5 / 4, 1.5 / 2)) and (w, h) == pytest.approx((aw / 4, ah / 2))


# ---- plans --------------------------------------------------------------------------------------
def test_a_plan_keeps_its_size_through_json_and_checks_it():
    desc = describe_model("yolov2-16", WIDE, classes=5)
    plan = Plan("yolov2-16", WIDE, 8, 2, [Stage(0, 17, "tiles", ["a", "b"], grid=(1, 2), tile_devices=["a", "b"])])
    d = json.loads(plan.to_json())
    assert d["img_size"] == "64x32" and Plan.from_dict(d).img_size == WIDE
    plan.validate(desc)
    with pytest.raises(ValueError, match="the plan is for 64x32 images, the model is built for 32x64"):
        plan.validate(describe_model("yolov2-16", "32x64", classes=5))
    tall_grid = Plan("yolov2-16", WIDE, 8, 2, [Stage(0, 17, "tiles", ["a", "b", "c"], grid=(3, 1),
                                                      tile_devices=["a", "b", "c"])])
    with pytest.raises(ValueError, match="grid 3x1 does not fit the 2x4 output of layer"):
        tall_grid.validate(desc)  # 3 rows of tiles over 2 rows of cells; 3 columns would fit


def test_plan_a_wide_input_tiles_along_its_width(tmp_path):
    from tests.test_planner_cli import EXAMPLES

    r = run_swarm("plan", "--model", "yolov2-16", "--img-size", "608x352", "--devices",
                  EXAMPLES / "rama-pi-cluster.json", "--strategy", "tiles", "--batch-size", "4", "--json",
                  cwd=tmp_path,
                  env={"SWARM_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    plan = Plan.from_dict(json.loads(r.stdout))
    assert plan.img_size == ImageSize(608, 352)
    rows, cols = plan.stages[0].grid
    assert cols > rows  # more tiles along the longer side
    plan.validate(describe_model("yolov2-16", ImageSize(608, 352), classes=5))


# ---- the command line, end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "wide.pt"
    r = run_swarm("train", "--model", "yolov2-16", "--img-size", "64x32", "--steps", "2", "--batch-size", "4",
                  "--strategy", "local", "--no-eval", "--save", path, "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "64x32 input" in r.stderr
    return path


def test_train_at_64x32_records_the_size(wide_checkpoint):
    state = load_checkpoint(wide_checkpoint)
    assert state["img_size"] == WIDE and state["config"]["img_size"] == WIDE
    assert torch.load(wide_checkpoint, weights_only=True)["img_size"] == "64x32"
    assert state["model"]["layers.16.conv.weight"].shape[0] == 5 * (5 + 5)


def test_detect_maps_boxes_back_onto_a_photo_of_another_shape(wide_checkpoint, tmp_path, capsys):
    """A 90x120 (portrait) photo through a 64x32 network: letterboxed into the middle 24 columns;
    every box comes back relative to the photo, where the network's own boxes, mapped by hand,
    put it."""
    from swarm.cli import main
    from swarm.local.detect import Detector

    arr, _ = SyntheticShapes("heldout", ImageSize(90, 120)).load(0)
    Image.fromarray(arr.transpose(1, 2, 0)).save(tmp_path / "portrait.png")
    assert main(["detect", "--checkpoint", str(wide_checkpoint), str(tmp_path / "portrait.png"), "--conf", "0.001",
                 "--json", "--out", str(tmp_path / "out"), "--threads", "1"]) == 0
    (rec,) = json.loads(capsys.readouterr().out)
    assert (rec["width"], rec["height"]) == (90, 120) and rec["boxes"]
    detector = Detector(load_checkpoint(wide_checkpoint), conf=0.001)
    with Image.open(tmp_path / "portrait.png") as im:
        x, letterbox = image_to_input(im, WIDE, 3)
    assert letterbox.placed == (20, 0, 24, 32)
    with torch.no_grad():
        (det,) = detector.loss.detections(detector.net(torch.from_numpy(x[None])), 0.001, 0.45)
    assert len(det) == len(rec["boxes"])
    for box, row in zip(rec["boxes"], det.tolist()):
        cx, cy, w, h = row[2] * 64, row[3] * 32, row[4] * 64, row[5] * 32  # input pixels
        want = ((cx - 20) / 24, cy / 32, w / 24, h / 32)  # the photo fills 24x32 pixels from column 20
        assert [box["cx"], box["cy"], box["w"], box["h"]] == pytest.approx(want, abs=1e-6)
        assert box["box"][0] == pytest.approx((want[0] - want[2] / 2) * 90, abs=0.06)
    with Image.open(tmp_path / "out" / "portrait.jpg") as drawn:
        assert drawn.size == (90, 120)


def test_a_checkpoint_runs_at_another_size_unless_its_weights_are_made_for_one(wide_checkpoint, tmp_path):
    """A fully convolutional detector evaluates at 32x64 too; lenet5's [connected] layers take
    one size, and another gets one line saying so."""
    from swarm.local.checkpoint import load_network, save_checkpoint
    from swarm.local.evaluate import evaluate
    from swarm.local.trainer import LocalTrainer, TrainConfig

    net, desc, _ = load_network(load_checkpoint(wide_checkpoint), "wide", ImageSize(32, 64))
    assert desc.extra["grid"] == (4, 2)
    result = evaluate(net, desc, SyntheticShapes("heldout", desc.img_size, 3, size=4))
    assert result.metric == "mAP@0.5" and result.samples == 4 and 0 <= result.value <= 1
    save_checkpoint(tmp_path / "lenet.pt", LocalTrainer(TrainConfig(model="lenet5", seed=1)).state())
    assert torch.load(tmp_path / "lenet.pt", weights_only=True)["img_size"] == 32  # a square is an int, as before
    assert load_checkpoint(tmp_path / "lenet.pt")["img_size"] == ImageSize(32, 32)
    with pytest.raises(SwarmError, match="lenet.pt: the weights do not fit lenet5 at --img-size 48x32 "
                                         r"\(it was trained at 32\)"):
        load_network(load_checkpoint(tmp_path / "lenet.pt"), str(tmp_path / "lenet.pt"), ImageSize(48, 32))


def test_darknet_export_writes_the_size_and_the_anchors_trained_with(wide_checkpoint, tmp_path, capsys):
    """The .cfg says 64x32, and its anchors are those scaled for 64x32: read back, the network
    decodes boxes as the trained one does."""
    from swarm.cli import main

    assert main(["export", "--checkpoint", str(wide_checkpoint), "--format", "darknet", "--out",
                 str(tmp_path / "wide")]) == 0
    text = (tmp_path / "wide.cfg").read_text()
    assert "width=64" in text and "height=32" in text
    back = describe_model(str(tmp_path / "wide.cfg"))
    trained = describe_model("yolov2-16", WIDE, classes=5)
    assert back.img_size == WIDE and back.extra["grid"] == (2, 4)
    assert np.allclose(back.extra["anchors"], trained.extra["anchors"], rtol=1e-5)
    assert not np.allclose(back.extra["anchors"], describe_model("yolov2-16", 416).extra["anchors"])

