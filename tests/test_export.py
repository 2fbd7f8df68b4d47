"""swarm export and swarm train --weights: ONNX and TorchScript compute what torch computes, darknet
files have darknet's layout and come back as the same tensors (whole, or a backbone's first
layers), and files that do not fit or are not checkpoints get one line, not a traceback."""
from __future__ import annotations

import importlib.util
import io
import struct
import warnings

import numpy as np
import pytest
import torch

from swarm.cli import main
from swarm.commands.export_cmd import checkpoint_network
from swarm.local.checkpoint import load_checkpoint
from swarm.local.trainer import LocalTrainer, TrainConfig, train
from swarm.zoo.darknet_weights import read_weights, weighted_layers, write_weights
from tests.conftest import run_swarm

DETECTOR = {"model": "yolov2-16", "img_size": "64x32"}  # BatchNorm convolutions, a [region] head, W x H
CLASSIFIER = {"model": "lenet5"}  # convolutions with biases, two [connected] layers
BATCH, STEPS = 4, 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints of a detector and a classifier after a few real optimizer steps."""
    folder = tmp_path_factory.mktemp("trained")
    paths = {}
    for name, model in (("detector", DETECTOR), ("classifier", CLASSIFIER)):
        cfg = TrainConfig(**model, batch_size=BATCH, steps=STEPS, seed=3)
        paths[name] = folder / f"{name}.pt"
        train(cfg, save=str(paths[name]), threads=1, evaluate_at_end=False, log=lambda s: None)
    return paths


def _export(capsys, checkpoint, fmt, out) -> str:
    assert main(["export", "--checkpoint", str(checkpoint), "--format", fmt, "--out", str(out), "--threads", "1"]) == 0
    return capsys.readouterr().out


def _torch_output(checkpoint, x):
    net, _, _ = checkpoint_network(load_checkpoint(checkpoint), str(checkpoint))
    with torch.no_grad():
        return net(x)


def _other_batch(checkpoint):
    """Three images, unlike the two the command checks itself on: the batch size stays free."""
    _, desc, _ = checkpoint_network(load_checkpoint(checkpoint), str(checkpoint))
    return torch.rand(3, desc.in_channels, *desc.img_size.hw, generator=torch.Generator().manual_seed(9))


def _assert_close(got, expected):
    got = torch.as_tensor(got)
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))


ONNX_MISSING = [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(bool(ONNX_MISSING), reason=f"{', '.join(ONNX_MISSING)} not installed (the test extra has them)")
@pytest.mark.parametrize("which", ["detector", "classifier"])
def test_onnx_in_onnxruntime_gives_the_torch_output(trained, tmp_path, capsys, which):
    import onnxruntime

    out = _export(capsys, trained[which], "onnx", tmp_path / "m.onnx")
    assert "onnxruntime against torch: max abs difference" in out
    x = _other_batch(trained[which])
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[1:] == list(x.shape[1:])  # (C, H, W): (3, 32, 64) for the detector
    _assert_close(session.run(None, {"images": x.numpy()})[0], _torch_output(trained[which], x))


@pytest.mark.parametrize("which", ["detector", "classifier"])
def test_torchscript_gives_the_torch_output(trained, tmp_path, capsys, which):
    out = _export(capsys, trained[which], "torchscript", tmp_path / "m.ts")
    assert "TorchScript against torch: max abs difference" in out
    x = _other_batch(trained[which])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates TorchScript for torch.export
        got = torch.jit.load(str(tmp_path / "m.ts"))(x)
    _assert_close(got, _torch_output(trained[which], x))


def _floats(path, start, count):
    return np.frombuffer(path.read_bytes(), dtype="<f4", count=count, offset=start)


def _started_from(weights, **model) -> LocalTrainer:
    cfg = TrainConfig(**model, weights=str(weights), seed=11)  # another seed: nothing equal by chance
    return LocalTrainer(cfg)


def _same_weights(loaded: dict, saved: dict, layers=None) -> None:
    """Every tensor equal, BatchNorm running statistics included (not num_batches_tracked, which
    darknet does not keep and torch reads only when BatchNorm's momentum is None)."""
    keys = [k for k in saved if not k.endswith("num_batches_tracked")
            and (layers is None or int(k.split(".")[1]) in layers)]
    assert keys
    for k in keys:
        assert torch.equal(loaded[k], saved[k]), k


def test_darknet_export_has_darknets_layout_and_imports_as_the_same_tensors(trained, tmp_path, capsys):
    state = load_checkpoint(trained["detector"])
    out = _export(capsys, trained["detector"], "darknet", tmp_path / "det")
    assert "read back identical" in out
    weights, cfg = tmp_path / "det.weights", tmp_path / "det.cfg"
    data = weights.read_bytes()
    assert struct.unpack("<3iQ", data[:20]) == (0, 2, 0, STEPS * BATCH)  # version 0.2.0, images seen
    model = state["model"]
    assert len(data) == 20 + 4 * sum(v.numel() for k, v in model.items() if not k.endswith("num_batches_tracked"))
    first = model["layers.0.conv.weight"].shape[0]  # BN biases, scales, rolling mean, rolling variance, weights
    expected = torch.cat([model[f"layers.0.bn.{k}"] for k in ("bias", "weight", "running_mean", "running_var")]
                         + [model["layers.0.conv.weight"].flatten()])
    assert np.array_equal(_floats(weights, 20, 4 * first + model["layers.0.conv.weight"].numel()), expected.numpy())
    # the .cfg says the trained size and class count: it builds the same network
    text = cfg.read_text()
    assert "width=64" in text and "height=32" in text and f"classes={state['config']['classes']}" in text
    trainer = _started_from(weights, model=str(cfg))
    n = len(weighted_layers(trainer.desc))
    assert trainer.started_from.endswith(f"{n} of {n} layers with weights loaded (layers 0-16)")
    _same_weights(trainer.net.state_dict(), model)
    # and as --model yolov2-16, the way a user goes on training it
    _same_weights(_started_from(weights, **DETECTOR, classes=state["config"]["classes"]).net.state_dict(), model)


def _region_as_opencv_gives_it(out: torch.Tensor, head: dict) -> np.ndarray:
    """A [region] head's raw map (b, anchors x (5 + classes), h, w) decoded as OpenCV's darknet
    reader's region layer writes it (modules/dnn/src/layers/region_layer.cpp): one row per
    cell and anchor, (y, x, anchor) order: x, y, w, h as fractions of the image, the
    objectness, then each class's softmax times the objectness where above `thresh`, else 0."""
    num, classes = head["num"], head["classes"]
    b, _, gh, gw = out.shape
    p = out.double().view(b, num, 5 + classes, gh, gw).permute(0, 3, 4, 1, 2)
    anchors = torch.tensor(head["anchors"], dtype=torch.float64)
    gy, gx = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    boxes = torch.empty_like(p)
    boxes[..., 0] = (gx[..., None] + p[..., 0].sigmoid()) / gw
    boxes[..., 1] = (gy[..., None] + p[..., 1].sigmoid()) / gh
    boxes[..., 2] = p[..., 2].exp() * anchors[:, 0] / gw
    boxes[..., 3] = p[..., 3].exp() * anchors[:, 1] / gh
    boxes[..., 4] = p[..., 4].sigmoid()
    prob = p[..., 5:].softmax(-1) * boxes[..., 4:5]
    boxes[..., 5:] = torch.where(prob > head["thresh"], prob, torch.zeros_like(prob))
    return boxes.reshape(b, gh * gw * num, 5 + classes).numpy()


def test_a_darknet_export_gives_the_torch_output_in_opencvs_darknet_reader(trained, tmp_path, capsys):
    """Not our own reader: OpenCV's (cv2.dnn.readNetFromDarknet) builds the exported .cfg and
    .weights and computes what torch computes (a [region] written without softmax=1 was
    refused by it, and darknet itself would read the class scores without their softmax)."""
    import cv2

    _export(capsys, trained["detector"], "darknet", tmp_path / "det")
    assert "softmax=1" in (tmp_path / "det.cfg").read_text()
    _, desc, _ = checkpoint_network(load_checkpoint(trained["detector"]), str(trained["detector"]))
    x = _other_batch(trained["detector"])
    reader = cv2.dnn.readNetFromDarknet(str(tmp_path / "det.cfg"), str(tmp_path / "det.weights"))
    reader.setInput(x.numpy())
    got = reader.forward()
    expected = _region_as_opencv_gives_it(_torch_output(trained["detector"], x), desc.extra)
    _assert_close(got, torch.from_numpy(expected))


def _yolo_as_opencv_gives_it(out: torch.Tensor, head: dict, img_hw: tuple[int, int]) -> np.ndarray:
    """A [yolo] head's raw map decoded as OpenCV's darknet reader writes it (its region layer
    in YOLO form): rows as for [region]; x and y with scale_x_y, w and h from the masked
    anchors in pixels of the input, logistic objectness and classes, each class times the
    objectness. With new_coords=1 the conv before it has applied the logistic already: w and h
    are 4 v^2 times the anchor."""
    num, classes = len(head["mask"]), head["classes"]
    b, _, gh, gw = out.shape
    p = out.double().view(b, num, 5 + classes, gh, gw).permute(0, 3, 4, 1, 2)
    anchors = torch.tensor([head["anchors"][m] for m in head["mask"]], dtype=torch.float64)
    gy, gx = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    act = (lambda v: v) if head["new_coords"] else torch.sigmoid
    size = (lambda v: 4 * v * v) if head["new_coords"] else torch.exp
    s, (h, w) = head["scale_x_y"], img_hw
    boxes = torch.empty_like(p)
    boxes[..., 0] = (gx[..., None] + (act(p[..., 0]) - 0.5) * s + 0.5) / gw
    boxes[..., 1] = (gy[..., None] + (act(p[..., 1]) - 0.5) * s + 0.5) / gh
    boxes[..., 2] = size(p[..., 2]) * anchors[:, 0] / w
    boxes[..., 3] = size(p[..., 3]) * anchors[:, 1] / h
    boxes[..., 4] = act(p[..., 4])
    boxes[..., 5:] = act(p[..., 5:]) * boxes[..., 4:5]
    return boxes.reshape(b, gh * gw * num, 5 + classes).numpy()


# Networks of every head kind and block darknet writes, that OpenCV's darknet reader also
# builds (it refuses relu6 (mobilenetv2), and stops in a shape check on efficientnet-b0,
# whatever the weights): two [yolo] heads, CSP route groups, three heads with new_coords, residual
# blocks, and resnet18's and resnet50's [shortcut]s that add a map of twice the size (and fewer
# channels), which it refuses as darknet's cfgs write them and reads as the export writes them,
# the subsampling as layers of its own.
OPENCV_NETWORKS = {"yolov3-tiny": 64, "yolov4-tiny": 64, "yolov7-tiny": 64, "darknet53": 64, "resnet18": 64,
                   "resnet50": 64}


@pytest.mark.parametrize("name", sorted(OPENCV_NETWORKS))
def test_a_trained_graph_network_exports_to_darknet_as_opencv_reads_it(name, tmp_path, capsys):
    """After two optimizer steps: OpenCV's reader gives every head's output as torch does
    (a detector's decoded as OpenCV decodes it, a classifier's softmax)."""
    import cv2

    checkpoint = tmp_path / "m.pt"
    cfg = TrainConfig(model=name, img_size=OPENCV_NETWORKS[name], batch_size=2, steps=2, seed=3)
    train(cfg, save=str(checkpoint), threads=1, evaluate_at_end=False, log=lambda s: None)
    assert "read back identical" in _export(capsys, checkpoint, "darknet", tmp_path / "m")
    _, desc, _ = checkpoint_network(load_checkpoint(checkpoint), str(checkpoint))
    x = _other_batch(checkpoint)
    reader = cv2.dnn.readNetFromDarknet(str(tmp_path / "m.cfg"), str(tmp_path / "m.weights"))
    reader.setInput(x.numpy())
    got = reader.forward(reader.getUnconnectedOutLayersNames())
    out = _torch_output(checkpoint, x)
    if desc.detects:
        assert len(got) == len(out) == len(desc.extra["heads"]) > 1
        for mine, head, raw in zip(got, desc.extra["heads"], out):
            expected = _yolo_as_opencv_gives_it(raw, head, desc.img_size.hw)
            _assert_close(mine.reshape(expected.shape), torch.from_numpy(expected))
    else:
        _assert_close(got[0].reshape(len(x), -1), torch.softmax(out.flatten(1).double(), 1))


def _conv(filters: int, stride: int = 1, act: str = "leaky", size: int = 3) -> str:
    return (f"[convolutional]\nbatch_normalize=1\nfilters={filters}\nsize={size}\nstride={stride}\npad=1\n"
            f"activation={act}\n")


# Two [shortcut]s that add a larger map (layer 0's 16x16 at strides 2 and 4, with fewer channels),
# then a route that names layers before both of them, counted back and from the start.
SUBSAMPLING = ("[net]\nwidth=16\nheight=16\nchannels=3\n\n# 0\n" + _conv(4) + "\n# 1\n" + _conv(8, 2, "linear")
               + "\n# 2\n[shortcut]\nfrom=-2\nactivation=leaky\n\n# 3\n" + _conv(8, 2) + "\n# 4\n[shortcut]\nfrom=0\n"
               "\n# 5\n[route]\nlayers=-4,2\n\n# 6\n" + _conv(8, 2) + "\n# 7\n[shortcut]\nfrom=-3\n\n# 8\n[avgpool]\n"
               "\n# 9\n[convolutional]\nfilters=5\nsize=1\nstride=1\npad=1\nactivation=linear\n\n[softmax]\n")


def _written_and_read_back(text: str, tmp_path, size: int = 16):
    """(network, the .cfg darknet_cfg writes for it, that .cfg's network as swarm reads it with
    the written weights): BatchNorm statistics drawn, so that every layer's arrays matter."""
    from swarm.zoo import build_model
    from swarm.zoo.darknet_weights import darknet_cfg

    net, desc, _ = build_model("m.cfg", size, seed=5, cfg_text=text)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for k, v in net.state_dict().items():
            if k.endswith(("running_mean", "bn.bias")):
                v.copy_(torch.randn(v.shape, generator=gen) * 0.1)
            elif k.endswith("running_var"):
                v.copy_(torch.rand(v.shape, generator=gen) + 0.5)
    written, _ = darknet_cfg(text, desc, "m.cfg")
    buffer = io.BytesIO()
    write_weights(buffer, {k: v.numpy() for k, v in net.state_dict().items()}, desc)
    (tmp_path / "m.cfg").write_text(written)
    (tmp_path / "m.weights").write_bytes(buffer.getvalue())
    back, back_desc, _ = build_model("m.cfg", size, seed=7, cfg_text=written)
    state = back.state_dict()
    loaded = read_weights(buffer.getvalue(), {k: v.shape for k, v in state.items()}, back_desc)
    assert len(loaded.layers) == loaded.of_layers
    state.update({k: torch.from_numpy(v) for k, v in loaded.tensors.items()})
    back.load_state_dict(state)
    return net.eval(), written, back.eval()


def _sections(text: str) -> list[tuple[str, dict]]:
    from swarm.zoo.darknet import parse_cfg

    return [(s.name, s.options) for s in parse_cfg(text)[1:]]


def test_a_shortcut_adding_a_larger_map_is_written_as_layers_darknet_opencv_and_swarm_read_alike(tmp_path):
    """Each from= map larger than the map before its [shortcut] is written as [route] to it,
    [maxpool] size=1 stride=k (every k-th pixel), [route] back; the layer indices after those
    (a route's, counted back and from the start) name the same layers as before, and so do the
    comments that number them. OpenCV's reader (which refuses the [shortcut]s as written first)
    and swarm's give the network's output."""
    import cv2

    net, written, back = _written_and_read_back(SUBSAMPLING, tmp_path)
    subsampled = [("route", {"layers": "-2"}), ("maxpool", {"size": "1", "stride": "2", "padding": "0"}),
                  ("route", {"layers": "-3"})]
    assert _sections(written)[2:14] == [*subsampled, ("shortcut", {"from": "-2", "activation": "leaky"}),
                                        ("convolutional", _sections(SUBSAMPLING)[3][1]),
                                        ("route", {"layers": "-7"}),
                                        ("maxpool", {"size": "1", "stride": "4", "padding": "0"}),
                                        ("route", {"layers": "-3"}), ("shortcut", {"from": "8"}),
                                        ("route", {"layers": "-10,5"}),  # layers 1 and 2, now 1 and 5
                                        ("convolutional", _sections(SUBSAMPLING)[6][1]), ("shortcut", {"from": "-3"})]
    assert "# 2-4, added on export: layer 0's 16x16 map sampled with stride 2 to 8x8" in written
    assert [n for n in range(16) if f"\n# {n}\n" in written] == [0, 1, 5, 6, 10, 11, 12, 13, 14, 15]
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = net(x)
        _assert_close(back(x), expected)
    reader = cv2.dnn.readNetFromDarknet(str(tmp_path / "m.cfg"), str(tmp_path / "m.weights"))
    reader.setInput(x.numpy())
    _assert_close(reader.forward().reshape(len(x), -1), torch.softmax(expected.flatten(1).double(), 1))


def test_a_shortcut_adding_two_larger_maps_and_a_yolo_embedding_layer_are_renumbered(tmp_path):
    """Each of several larger from= maps gets its [route], [maxpool] pair, then one [route]
    back; a [yolo] head's embedding_layer= (AlexeyAB's darknet) is moved on as a route's layers
    are; swarm's reader gives the network's outputs."""
    text = ("[net]\nwidth=16\nheight=16\n\n" + _conv(4) + _conv(8, 2) + _conv(8, 2) + "[shortcut]\nfrom=-3,-2\n"
            + _conv(18, 1, "linear", 1) + "[yolo]\nmask=0,1,2\nanchors=2,3, 4,5, 6,7\nclasses=1\nnum=3\n"
            "embedding_layer=-4\n")
    net, written, back = _written_and_read_back(text, tmp_path)
    assert [(name, options.get("layers", options.get("from", options.get("stride"))))
            for name, options in _sections(written)[3:9]] == [
        ("route", "-3"), ("maxpool", "4"), ("route", "-4"), ("maxpool", "2"), ("route", "-5"), ("shortcut", "-4,-2")]
    assert _sections(written)[10][1]["embedding_layer"] == "-9"  # layer 1, as before
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _assert_close(back(x), net(x))


def test_a_shortcut_adding_a_smaller_map_is_written_as_it_is_with_a_note(tmp_path):
    """darknet's shortcut_cpu adds a smaller map at every k-th pixel of the larger: no layers
    both readers know do that, so the [shortcut] stays as it was, and the export says so."""
    from swarm.zoo import build_model
    from swarm.zoo.darknet_weights import darknet_cfg

    text = "[net]\nwidth=16\nheight=16\n\n" + _conv(4, 2) + _conv(4) + "[upsample]\nstride=2\n[shortcut]\nfrom=-2\n"
    _, desc, _ = build_model("m.cfg", 16, seed=5, cfg_text=text)
    written, notes = darknet_cfg(text, desc, "m.cfg")
    assert written == text
    assert notes == ["m.cfg:21 [shortcut]: adds layer 1's map, 2 times smaller, at stride 2 as darknet's shortcut_cpu "
                     "does; AlexeyAB's darknet and OpenCV's reader add maps of one size only"]


def test_darknet_round_trip_of_a_classifier_with_connected_layers(trained, tmp_path, capsys):
    state = load_checkpoint(trained["classifier"])
    _export(capsys, trained["classifier"], "darknet", tmp_path / "cls.weights")  # the suffix is optional
    weights = tmp_path / "cls.weights"
    model = state["model"]
    fc = [model["layers.6.fc.bias"], model["layers.6.fc.weight"].flatten()]  # the last layer: biases, then weights
    count = sum(t.numel() for t in fc)
    assert np.array_equal(_floats(weights, len(weights.read_bytes()) - 4 * count, count), torch.cat(fc).numpy())
    _same_weights(_started_from(weights, **CLASSIFIER, classes=state["config"]["classes"]).net.state_dict(), model)


def test_older_darknet_headers_read_the_same(trained):
    """Version 0.1 files keep `seen` in an int32; versions above 1000 store connected weights
    transposed (darknet's load_weights_upto: `(major > 1000) || (minor > 1000)`)."""
    state = load_checkpoint(trained["classifier"])
    _, desc, _ = checkpoint_network(state, "classifier")
    arrays = {k: v.numpy() for k, v in state["model"].items()}
    shapes = {k: v.shape for k, v in arrays.items()}
    buffer = io.BytesIO()
    write_weights(buffer, arrays, desc, seen=12)
    current = read_weights(buffer.getvalue(), shapes, desc)
    old = struct.pack("<3ii", 0, 1, 0, 12) + buffer.getvalue()[20:]
    transposed = bytearray(struct.pack("<3ii", 1001, 0, 0, 12))
    for _, keys in weighted_layers(desc):
        for key in keys:
            transposed += np.ascontiguousarray(arrays[key].T if key.endswith("fc.weight") else arrays[key],
                                               dtype="<f4").tobytes()
    for other in (read_weights(old, shapes, desc), read_weights(bytes(transposed), shapes, desc)):
        assert other.seen == current.seen == 12 and other.layers == current.layers
        assert all(np.array_equal(other.tensors[k], v) for k, v in current.tensors.items())


def test_a_backbone_file_loads_only_its_layers(trained, tmp_path, capsys):
    state = load_checkpoint(trained["detector"])
    _export(capsys, trained["detector"], "darknet", tmp_path / "det")
    model = state["model"]
    covered = [0, 2, 4]  # the first three convolutions, as `darknet partial ... 3` would cut them
    size = 20 + 4 * sum(model[k].numel() for k in model if int(k.split(".")[1]) in covered
                        and not k.endswith("num_batches_tracked"))
    backbone = tmp_path / "det.conv.3"
    backbone.write_bytes((tmp_path / "det.weights").read_bytes()[:size])
    classes = state["config"]["classes"]
    trainer = _started_from(backbone, **DETECTOR, classes=classes)
    assert f"3 of {len(weighted_layers(trainer.desc))} layers with weights loaded (layers 0-4)" in trainer.started_from
    loaded = trainer.net.state_dict()
    _same_weights(loaded, model, covered)
    fresh = LocalTrainer(TrainConfig(**DETECTOR, classes=classes, seed=11)).net.state_dict()
    rest = [k for k in fresh if int(k.split(".")[1]) not in covered]
    assert rest and all(torch.equal(loaded[k], fresh[k]) for k in rest)  # initialised as without --weights


def test_a_swarm_checkpoint_as_weights(trained):
    state = load_checkpoint(trained["detector"])
    trainer = _started_from(trained["detector"], **DETECTOR, classes=state["config"]["classes"])
    assert f"step {STEPS} of yolov2-16" in trainer.started_from
    _same_weights(trainer.net.state_dict(), state["model"])
    assert trainer.step_count == 0  # the weights only: a new run


def _one_line_error(r, *parts):
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("swarm "), r.stderr
    for part in parts:
        assert part in line, r.stderr


QUICK = ["--img-size", "32", "--batch-size", "4", "--steps", "1", "--threads", "1", "--no-eval", "--save", "o.pt"]


def test_weights_that_do_not_fit_name_the_layer_and_both_shapes(trained, tmp_path, capsys):
    _export(capsys, trained["detector"], "darknet", tmp_path / "det")
    state = load_checkpoint(trained["detector"])
    classes, model = state["config"]["classes"], state["model"]
    other = classes + 2
    head = model["layers.16.conv.weight"].shape[1]
    file_shape, model_shape = f"{5 * (5 + classes)}x{head}x1x1", f"{5 * (5 + other)}x{head}x1x1"
    r = run_swarm("train", "--model", "yolov2-16", "--classes", other, *QUICK, "--weights", "det.weights", cwd=tmp_path)
    _one_line_error(r, "does not fit yolov2-16 at layer 16", f"weights there are {file_shape}, the model's {model_shape}")
    r = run_swarm("train", "--model", "yolov2-16", "--classes", other, *QUICK, "--weights", trained["detector"],
                  cwd=tmp_path)
    _one_line_error(r, "at layer 16", f"conv.weight is {file_shape} in the file and {model_shape} in the model")
    cut = 20 + 4 * sum(v.numel() for k, v in model.items() if k.startswith(("layers.0.", "layers.2."))
                       and not k.endswith("num_batches_tracked")) + 4000  # 1000 values into layer 4
    (tmp_path / "cut.weights").write_bytes((tmp_path / "det.weights").read_bytes()[:cut])
    r = run_swarm("train", "--model", "yolov2-16", "--classes", classes, *QUICK, "--weights", "cut.weights",
                  cwd=tmp_path)
    shape = "x".join(map(str, model["layers.4.conv.weight"].shape))
    _one_line_error(r, "cut.weights ends inside layer 4", f"conv.weight {shape}", "the file has 1000 left")


def test_files_that_are_not_checkpoints_say_what_they_are(trained, tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    torch.save({"conv1.weight": torch.zeros(2)}, tmp_path / "plain.pt")
    (tmp_path / "d.weights").write_bytes(struct.pack("<3iQ", 0, 2, 0, 0) + bytes(64))
    _one_line_error(run_swarm("eval", "--checkpoint", "notes.txt", cwd=tmp_path),
                    "notes.txt is not a swarm checkpoint: it is a text file")
    _one_line_error(run_swarm("train", "--resume", "plain.pt", cwd=tmp_path),
                    "plain.pt is not a swarm checkpoint: it is a torch state dict", "without 'model'")
    _one_line_error(run_swarm("export", "--checkpoint", "d.weights", "--format", "onnx", "--out", "m.onnx",
                              cwd=tmp_path), "d.weights is not a swarm checkpoint: it looks like darknet weights")
    _one_line_error(run_swarm("train", "--model", "yolov2-16", *QUICK, "--weights", "notes.txt", cwd=tmp_path),
                    "notes.txt is neither darknet weights nor a swarm checkpoint: it is a text file")
    _one_line_error(run_swarm("train", "--resume", trained["detector"], "--weights", "d.weights", cwd=tmp_path),
                    "give one of them")



@pytest.fixture(scope="module")
def two_heads(tmp_path_factory):
    """A trained yolov3-tiny (darknet's cfg): two [yolo] heads at two depths."""
    from pathlib import Path

    path = tmp_path_factory.mktemp("heads") / "yolov3-tiny.pt"
    cfg = TrainConfig(model=str(Path(__file__).resolve().parent / "cfg" / "darknet" / "yolov3-tiny.cfg"), img_size=64,
                      batch_size=BATCH, steps=2, seed=3)
    train(cfg, save=str(path), threads=1, evaluate_at_end=False, log=lambda s: None)
    return path


@pytest.mark.skipif(bool(ONNX_MISSING), reason=f"{', '.join(ONNX_MISSING)} not installed (the test extra has them)")
def test_every_head_is_exported_and_computes_what_torch_computes(two_heads, tmp_path, capsys):
    import onnxruntime

    out = _export(capsys, two_heads, "onnx", tmp_path / "m.onnx")
    assert "'output0' (batch, 255, 2, 2), 'output1' (batch, 255, 4, 4)" in out and "onnxruntime against torch" in out
    x = _other_batch(two_heads)
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got, expected = session.run(None, {"images": x.numpy()}), _torch_output(two_heads, x)
    assert [o.name for o in session.get_outputs()] == ["output0", "output1"] and len(expected) == 2
    for g, e in zip(got, expected):
        _assert_close(g, e)
    out = _export(capsys, two_heads, "torchscript", tmp_path / "m.ts")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = torch.jit.load(str(tmp_path / "m.ts"))(x)
    for g, e in zip(got, expected):
        _assert_close(g, e)


def test_darknet_format_of_a_network_with_a_detection_head_is_refused_in_one_line(tmp_path):
    """YOLOv1's [detection] head is the one darknet head not written back."""
    from pathlib import Path

    cfg = TrainConfig(model=str(Path(__file__).resolve().parent / "cfg" / "darknet" / "yolov1-tiny.cfg"), img_size=64,
                      batch_size=2, steps=1, seed=3)
    train(cfg, save=str(tmp_path / "y1.pt"), threads=1, evaluate_at_end=False, log=lambda s: None)
    _one_line_error(run_swarm("export", "--checkpoint", "y1.pt", "--format", "darknet", "--out", "m", cwd=tmp_path),
                    "has a [detection] head: export it as onnx or torchscript")


def test_a_depthwise_network_round_trips_whole_and_as_a_backbone(tmp_path, capsys):
    """mobilenetv2 (depthwise and grouped 1x1 convolutions, [shortcut]s) written in darknet's
    layout reads back bit for bit, whole and as `darknet partial` would cut its first five
    weighted layers; the layers after those start as without --weights."""
    checkpoint = tmp_path / "m.pt"
    train(TrainConfig(model="mobilenetv2", img_size=64, batch_size=2, steps=2, seed=3), save=str(checkpoint),
          threads=1, evaluate_at_end=False, log=lambda s: None)
    state = load_checkpoint(checkpoint)
    model, classes = state["model"], state["config"]["classes"]
    _export(capsys, checkpoint, "darknet", tmp_path / "m")
    _same_weights(_started_from(tmp_path / "m.weights", model="mobilenetv2", img_size=64, classes=classes)
                  .net.state_dict(), model)
    desc = _started_from(tmp_path / "m.weights", model="mobilenetv2", img_size=64, classes=classes).desc
    covered = [d.index for d, _ in weighted_layers(desc)][:5]
    assert any(desc.layers[i].groups > 1 for i in covered)  # a depthwise layer among them
    size = 20 + 4 * sum(model[k].numel() for k in model if int(k.split(".")[1]) in covered
                        and not k.endswith("num_batches_tracked"))
    backbone = tmp_path / "m.conv.5"
    backbone.write_bytes((tmp_path / "m.weights").read_bytes()[:size])
    trainer = _started_from(backbone, model="mobilenetv2", img_size=64, classes=classes)
    assert f"5 of {len(weighted_layers(desc))} layers with weights loaded" in trainer.started_from
    loaded = trainer.net.state_dict()
    _same_weights(loaded, model, covered)
    fresh = LocalTrainer(TrainConfig(model="mobilenetv2", img_size=64, classes=classes, seed=11)).net.state_dict()
    rest = [k for k in fresh if int(k.split(".")[1]) not in covered]
    assert rest and all(torch.equal(loaded[k], fresh[k]) for k in rest)


def test_a_checkpoint_whose_weights_are_not_finite_is_refused_in_one_line(tmp_path):
    """A diverged run's weights (here one tensor set to NaN) are not exported in any format."""
    train(TrainConfig(**CLASSIFIER, batch_size=2, steps=1, seed=3), save=str(tmp_path / "c.pt"), threads=1,
          evaluate_at_end=False, log=lambda s: None)
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    key = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][key][0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    for fmt in ("darknet", "torchscript"):
        _one_line_error(run_swarm("export", "--checkpoint", "nan.pt", "--format", fmt, "--out", "m", cwd=tmp_path),
                        "holds weights that are not finite", key)
