"""darknet .weights against darknet's own layout: every built-in network written and read back bit
for bit, whole and as a `darknet partial` backbone (.conv.N); every header version darknet has
written; files cut short or running long refused in one line; and each layer kind's bytes pinned
against a reference written from darknet's src/parser.c, not against our own writer."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from torch import nn

from swarm.errors import SwarmError
from swarm.local.checkpoint import load_initial_weights
from swarm.zoo import BUILTIN, build_model
from swarm.zoo.darknet_weights import read_weights, write_weights
from tests.conftest import run_swarm

# A small size each built-in network takes (check_img_size refuses any other): the weights of
# convolutions do not depend on it, and a [connected] layer's inputs stay few.
SIZES = {"yolov2-16": 16, "yolov2": 32, "yolov2-tiny": 32, "yolov3-tiny": 32, "yolov4-tiny": 32, "yolov7-tiny": 32,
         "darknet53": 8, "resnet18": 8, "resnet50": 8, "mobilenetv2": 8, "efficientnet-b0": 8, "vgg16": 8,
         "alexnet": 72, "lenet5": 32}
GROUPED, DETECTOR = "mobilenetv2", "yolov4-tiny"  # depthwise convolutions (groups = channels); two [yolo] heads
SEEN = 7 * 2 ** 32 + 5  # images seen: needs darknet's 64-bit field


# --- darknet's layout, from src/parser.c ------------------------------------------------------

def darknet_arrays(layer: nn.Module) -> list[torch.Tensor]:
    """One layer's arrays in the order darknet writes them ([] for a layer without weights).

    save_convolutional_weights: biases (n); with batch_normalize scales, rolling_mean,
    rolling_variance (n each); weights (n * c/groups * size * size, [filters][c/groups][size][size]).
    save_connected_weights: biases (outputs); weights (outputs * inputs, [outputs][inputs]);
    with batch_normalize scales, rolling_mean, rolling_variance. With BatchNorm darknet's
    biases are what it adds after scaling: torch BatchNorm's bias."""
    parts = dict(layer.named_children()) if isinstance(layer, nn.Sequential) else {}
    bn = parts.get("bn")
    scaling = [] if bn is None else [bn.weight, bn.running_mean, bn.running_var]
    if "conv" in parts:
        conv = parts["conv"]
        n, c, groups, (size, _) = conv.out_channels, conv.in_channels, conv.groups, conv.kernel_size
        assert conv.weight.shape == (n, c // groups, size, size)
        return [conv.bias if bn is None else bn.bias, *scaling, conv.weight]
    if "fc" in parts:
        fc = parts["fc"]
        assert fc.weight.shape == (fc.out_features, fc.in_features)
        return [fc.bias if bn is None else bn.bias, fc.weight, *scaling]
    return []


def darknet_bytes(layer: nn.Module) -> bytes:
    return b"".join(t.detach().numpy().astype("<f4").tobytes() for t in darknet_arrays(layer))


def darknet_header(version: tuple[int, int, int] = (0, 2, 0), seen: int = 0) -> bytes:
    """int32 major, minor, revision; `seen` as load_weights_upto reads it: a size_t from
    version 0.2 on (and below 1000 each), an int before."""
    major, minor, _ = version
    wide = major * 10 + minor >= 2 and major < 1000 and minor < 1000
    return struct.pack("<3i", *version) + struct.pack("<Q" if wide else "<i", seen)


def darknet_file(net, upto: int | None = None, version=(0, 2, 0), seen: int = 0) -> bytes:
    """What darknet's save_weights_upto(net, file, upto) writes: the header, then the first
    `upto` layers (all of them by default) that have weights."""
    return darknet_header(version, seen) + b"".join(darknet_bytes(layer) for layer in list(net.layers)[:upto])


def floats_of(layer: nn.Module) -> int:
    return sum(t.numel() for t in darknet_arrays(layer))


# --- the networks -------------------------------------------------------------------------------

def perturb_batchnorm(net, seed: int) -> None:
    """Scales, biases and running statistics away from BatchNorm's defaults (1, 0, 0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                for t in (m.weight, m.bias, m.running_mean):
                    t.copy_(torch.randn(t.shape, generator=gen))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)


def layer_of(key: str) -> int:
    return int(key.split(".")[1])  # layers.N.*


def darknet_state(net) -> dict[str, torch.Tensor]:
    """The tensors darknet keeps: all but BatchNorm's num_batches_tracked."""
    return {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}


class Zoo:
    """Each network built once: the one written (seed 1, BatchNorm perturbed), the one read
    into (seed 2, as built). The networks later tests use again are kept, with the target's
    initial state to start each reading from."""

    KEEP = (GROUPED, DETECTOR)

    def __init__(self):
        self.kept: dict[str, tuple] = {}

    def pair(self, name: str):
        if name in self.kept:
            return self.kept[name][:3]
        source, desc, _ = build_model(name, SIZES[name], seed=1)
        perturb_batchnorm(source, seed=1)
        target, _, _ = build_model(name, SIZES[name], seed=2)
        if name in self.KEEP:
            self.kept[name] = (source, target, desc, {k: v.clone() for k, v in target.state_dict().items()})
        return source, target, desc

    def fresh_target(self, name: str):
        _, target, _, initial = self.kept[name]
        target.load_state_dict(initial)
        return target


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


def test_every_builtin_network_has_a_size_here():
    assert set(SIZES) == set(BUILTIN)


# --- 1. round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTIN)
def test_weights_and_a_backbone_prefix_round_trip_bit_exact(zoo, name, tmp_path):
    """Our writer gives darknet's bytes layer by layer; a `.conv.N` cut of it (darknet's partial:
    the first N layers) loads exactly those layers' tensors and leaves the others as they were;
    the whole file loads every tensor bit for bit into a network seeded otherwise."""
    source, target, desc = zoo.pair(name)
    state = darknet_state(source)
    buffer = io.BytesIO()
    write_weights(buffer, {k: v.numpy() for k, v in state.items()}, desc, seen=SEEN)
    data = buffer.getvalue()
    assert data[:20] == darknet_header((0, 2, 0), SEEN)
    pos = 20
    for i, layer in enumerate(source.layers):
        expected = darknet_bytes(layer)
        assert data[pos:pos + len(expected)] == expected, f"layer {i}"
        pos += len(expected)
    assert pos == len(data) == 20 + 4 * sum(v.numel() for v in state.values())  # every tensor, nothing more

    initial = darknet_state(target)  # the live tensors: they change as weights are loaded
    assert not any(torch.equal(initial[k], v) for k, v in state.items())  # nothing equal by chance
    cut = len(desc.layers) // 2
    covered = {i for i, layer in enumerate(source.layers) if i < cut and darknet_arrays(layer)}
    untouched = {k: v.clone() for k, v in initial.items() if layer_of(k) not in covered}
    assert covered and untouched
    prefix = tmp_path / f"{name}.conv.{cut}"
    prefix.write_bytes(data[:20 + 4 * sum(floats_of(layer) for layer in list(source.layers)[:cut])])
    load_initial_weights(target, prefix)
    for k, v in darknet_state(target).items():
        assert torch.equal(v, state[k] if layer_of(k) in covered else untouched[k]), k

    whole = tmp_path / f"{name}.weights"
    whole.write_bytes(data)
    load_initial_weights(target, whole)
    for k, v in darknet_state(target).items():
        assert torch.equal(v, state[k]), k


# --- 2. header versions -------------------------------------------------------------------------

# (version, seen): 0.1 keeps `seen` in an int32; pjreddie's darknet writes 0.2.0, AlexeyAB's 0.2.5,
# and 1.0 is past the change to 64 bits too. (tests/test_export.py reads 0.1 and the transposed
# [connected] weights of 1000 and up for lenet5.)
HEADERS = [((0, 1, 0), 123456789), ((0, 2, 0), SEEN), ((0, 2, 5), SEEN), ((1, 0, 0), SEEN)]


@pytest.mark.parametrize("name", [GROUPED, DETECTOR])
def test_every_header_version_reads_the_same_weights(zoo, name, tmp_path):
    source, _, desc = zoo.pair(name)
    if name == GROUPED:
        assert any(d.groups > 1 for d in desc.layers if d.kind == "conv")
    else:
        assert desc.loss == "yolo"
    state = darknet_state(source)
    path = tmp_path / f"{name}.weights"
    for version, seen in HEADERS:
        path.write_bytes(darknet_file(source, version=version, seen=seen))
        target = zoo.fresh_target(name)
        said = load_initial_weights(target, path)
        assert f"darknet {'.'.join(map(str, version))}, {seen} images seen" in said
        for k, v in darknet_state(target).items():
            assert torch.equal(v, state[k]), (version, k)


# --- 3. files cut short or running long ---------------------------------------------------------

# For each network a file cut short and one running long, as `swarm train --weights` meets them.
# Cut inside a value (an interrupted copy) is the case a whole-float check missed.
FAULTS = [(GROUPED, "cut inside a value"), (GROUPED, "7 values after the last layer"),
          (DETECTOR, "cut between values"), (DETECTOR, "3 values after the last layer")]


@pytest.mark.parametrize("name,fault", FAULTS)
def test_a_file_cut_short_or_running_long_is_refused_in_one_line(zoo, name, fault, tmp_path):
    """The line names the layer and how many values it needs and the file has; for the grouped
    network the cut falls in a depthwise layer."""
    source, _, desc = zoo.pair(name)
    data = darknet_file(source)
    weighted = [i for i, layer in enumerate(source.layers) if darknet_arrays(layer)]
    if fault.endswith("after the last layer"):
        extra, layer = int(fault.split()[0]), weighted[-1]
        need = floats_of(source.layers[layer])
        data += np.arange(extra, dtype="<f4").tobytes()
        parts = [f"at layer {layer} (", f"needs {need} values", f"the file has {need + extra} "]
    else:
        layers = [i for i in weighted if desc.layers[i].groups > 1] if name == GROUPED else weighted
        layer = layers[len(layers) // 2]
        need, before = floats_of(source.layers[layer]), sum(floats_of(m) for m in list(source.layers)[:layer])
        data = data[:20 + 4 * (before + need // 2) + (2 if fault == "cut inside a value" else 0)]
        parts = [f"ends inside layer {layer} (", f"needs {need} values", f"the file has {need // 2} "]
    (tmp_path / "bad.weights").write_bytes(data)
    r = run_swarm("train", "--model", name, "--img-size", SIZES[name], "--classes", desc.extra["classes"],
                  "--batch-size", "2", "--steps", "1", "--threads", "1", "--no-eval", "--save", "o.pt",
                  "--weights", "bad.weights", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarm train: error: bad.weights "), r.stderr
    for part in parts:
        assert part in lines[0], r.stderr
    assert not (tmp_path / "o.pt").exists()


def test_a_part_of_a_value_after_the_last_layer_is_refused_naming_it(zoo):
    source, _, desc = zoo.pair(DETECTOR)
    last = max(i for i, layer in enumerate(source.layers) if darknet_arrays(layer))
    shapes = {k: tuple(v.shape) for k, v in source.state_dict().items()}
    with pytest.raises(SwarmError, match=f"goes on 2 bytes after the last layer with weights, {last} "):
        read_weights(darknet_file(source) + bytes(2), shapes, desc)


# --- 4. each layer kind against darknet's source ------------------------------------------------

# One layer after [net]: its input (channels, height, width), its section, and darknet's arrays in
# file order: (the torch tensor it is, its shape in darknet's terms).
KINDS = {
    "conv with BatchNorm": ((3, 2, 3), "[convolutional]\nbatch_normalize=1\nfilters=4\nsize=3\npad=1\nactivation=leaky",
                            [("bn.bias", (4,)), ("bn.weight", (4,)), ("bn.running_mean", (4,)),
                             ("bn.running_var", (4,)), ("conv.weight", (4, 3, 3, 3))]),
    "conv": ((3, 2, 3), "[convolutional]\nfilters=4\nsize=3\npad=1\nactivation=leaky",
             [("conv.bias", (4,)), ("conv.weight", (4, 3, 3, 3))]),
    "grouped conv": ((4, 2, 3), "[convolutional]\nbatch_normalize=1\nfilters=6\nsize=3\npad=1\ngroups=2\n"
                     "activation=leaky",
                     [("bn.bias", (6,)), ("bn.weight", (6,)), ("bn.running_mean", (6,)), ("bn.running_var", (6,)),
                      ("conv.weight", (6, 2, 3, 3))]),
    "depthwise conv": ((4, 2, 3), "[convolutional]\nfilters=4\nsize=3\npad=1\ngroups=4\nactivation=relu6",
                       [("conv.bias", (4,)), ("conv.weight", (4, 1, 3, 3))]),
    "connected": ((2, 2, 3), "[connected]\noutput=5\nactivation=leaky", [("fc.bias", (5,)), ("fc.weight", (5, 12))]),
    "connected with BatchNorm": ((2, 2, 3), "[connected]\nbatch_normalize=1\noutput=5\nactivation=leaky",
                                 [("bn.bias", (5,)), ("fc.weight", (5, 12)), ("bn.weight", (5,)),
                                  ("bn.running_mean", (5,)), ("bn.running_var", (5,))]),
}


def one_layer(kind: str, seed: int):
    (c, h, w), section, _ = KINDS[kind]
    text = f"[net]\nwidth={w}\nheight={h}\nchannels={c}\n\n{section}\n"
    net, desc, _ = build_model("one.cfg", cfg_text=text, seed=seed)
    return net, desc


@pytest.mark.parametrize("kind", KINDS)
def test_each_layer_kind_is_written_in_darknets_order(kind):
    net, desc = one_layer(kind, seed=1)
    perturb_batchnorm(net, seed=1)
    state = net.state_dict()
    arrays = KINDS[kind][2]
    assert all(tuple(state[f"layers.0.{key}"].shape) == shape for key, shape in arrays)
    buffer = io.BytesIO()
    write_weights(buffer, {k: v.numpy() for k, v in state.items()}, desc)
    expected = b"".join(state[f"layers.0.{key}"].numpy().astype("<f4").tobytes() for key, _ in arrays)
    assert buffer.getvalue()[20:] == expected


@pytest.mark.parametrize("kind", KINDS)
def test_each_layer_kind_reads_darknets_arrays_into_the_right_tensors(kind, tmp_path):
    """Every value distinct (and positive, as variances are): a value read into the wrong
    tensor, or the wrong place in one, shows."""
    net, _ = one_layer(kind, seed=1)
    arrays = KINDS[kind][2]
    values = 1.0 + np.arange(sum(int(np.prod(shape)) for _, shape in arrays), dtype="<f4") / 64
    (tmp_path / "one.weights").write_bytes(darknet_header() + values.tobytes())
    load_initial_weights(net, tmp_path / "one.weights")
    state, pos = net.state_dict(), 0
    for key, shape in arrays:
        count = int(np.prod(shape))
        assert torch.equal(state[f"layers.0.{key}"], torch.from_numpy(values[pos:pos + count].reshape(shape))), key
        pos += count
