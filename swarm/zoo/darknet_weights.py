"""Darknet's .weights files (and the .cfg beside them): a network's weights written in darknet's binary layout, and read back, whole or as a backbone's first layers."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from planner.model_desc import LayerDesc, ModelDesc
from swarm.errors import SwarmError
from swarm.zoo.darknet import parse_cfg, set_options
from swarm.zoo.darknet_shortcuts import resized_shortcut_inputs, with_explicit_subsampling

# The file, as darknet's save_weights writes it and load_weights_upto reads it (src/parser.c):
#
#   int32 major, minor, revision          0, 2, 0 here
#   seen: uint64 images trained on        (int32 when major*10 + minor < 2, or major or minor >= 1000;
#                                         above 1000, connected weights are stored transposed)
#   then, for every [convolutional] and [connected] layer in order, float32 little-endian:
#     convolutional, batch_normalize=1:   biases (BN beta), scales (BN gamma), rolling mean, rolling variance,
#                                         weights (filters, channels, size, size)
#     convolutional:                      biases, weights
#     connected:                          biases, weights (outputs, inputs)
#                                         [then scales, rolling mean, rolling variance with batch_normalize=1]
#   A file may stop after any layer (a backbone such as darknet19_448.conv.23): darknet loads what is there.
VERSION = (0, 2, 0)
FLOAT = np.dtype("<f4")


def layer_keys(d: LayerDesc) -> list[str]:
    """The state_dict keys of one layer in the order darknet stores them ([] for a layer
    without weights)."""
    p = f"layers.{d.index}"
    if d.kind == "conv":
        head = ([f"{p}.bn.bias", f"{p}.bn.weight", f"{p}.bn.running_mean", f"{p}.bn.running_var"]
                if d.batch_normalize else [f"{p}.conv.bias"])
        return head + [f"{p}.conv.weight"]
    if d.kind == "connected":
        if d.batch_normalize:
            return [f"{p}.bn.bias", f"{p}.fc.weight", f"{p}.bn.weight", f"{p}.bn.running_mean", f"{p}.bn.running_var"]
        return [f"{p}.fc.bias", f"{p}.fc.weight"]
    return []


def weighted_layers(desc: ModelDesc) -> list[tuple[LayerDesc, list[str]]]:
    return [(d, keys) for d in desc.layers if (keys := layer_keys(d))]


def header_size(major: int, minor: int) -> int:
    """Bytes before the first layer: three int32 and `seen` (uint64 from version 0.2 on)."""
    return 20 if major * 10 + minor >= 2 and major < 1000 and minor < 1000 else 16


def looks_like_darknet(head: bytes, size: int) -> bool:
    """Whether a file of `size` bytes starting with `head` (16 bytes or more) can be darknet
    weights: small version numbers, and the whole header. (One cut short inside a value
    still is: read_weights says where it ends.)"""
    if len(head) < 16:
        return False
    major, minor, revision = struct.unpack("<3i", head[:12])
    if not (0 <= major < 1 << 16 and 0 <= minor < 1 << 16 and 0 <= revision < 1 << 16):
        return False
    return size >= header_size(major, minor)


def write_weights(f, state: Mapping[str, np.ndarray], desc: ModelDesc, seen: int = 0) -> int:
    """Write `state` (state_dict arrays of the network `desc` describes) to the binary file
    `f` in darknet's layout; returns the number of float values written."""
    f.write(struct.pack("<3iQ", *VERSION, seen))
    count = 0
    for _, keys in weighted_layers(desc):
        for key in keys:
            values = np.ascontiguousarray(np.asarray(state[key]), dtype=FLOAT)
            f.write(values.tobytes())
            count += values.size
    return count


@dataclass
class DarknetWeights:
    """What a .weights file held for a network: arrays by state_dict key, for its first layers."""

    tensors: dict[str, np.ndarray]
    layers: list[int]  # indices of the layers it covered
    of_layers: int  # layers with weights in the network
    version: tuple[int, int, int]
    seen: int


def read_weights(data: bytes, shapes: Mapping[str, tuple[int, ...]], desc: ModelDesc,
                 source: str = "weights") -> DarknetWeights:
    """Read darknet weights for the network `desc` (whose state_dict shapes are `shapes`).

    The file may cover only the first layers (a backbone); one that ends inside a layer,
    goes on after the last, or whose values cannot be this network's is a SwarmError
    naming the layer and what it needs."""
    if len(data) < 16:
        raise SwarmError(f"{source} is too short for darknet weights ({len(data)} bytes; the header alone is 16)")
    major, minor, revision = struct.unpack("<3i", data[:12])
    start = header_size(major, minor)
    if len(data) < start:
        raise SwarmError(f"{source} is too short for darknet weights ({len(data)} bytes; the header of version "
                         f"{major}.{minor} alone is {start})")
    seen = struct.unpack("<Q", data[12:20])[0] if start == 20 else struct.unpack("<i", data[12:16])[0]
    values = np.frombuffer(data, dtype=FLOAT, count=(len(data) - start) // 4, offset=start)
    loose = (len(data) - start) % 4  # bytes of a float32 value cut short: the file ends inside it
    transpose = major > 1000 or minor > 1000  # connected weights stored (inputs, outputs), as darknet reads them
    layers = weighted_layers(desc)
    tensors: dict[str, np.ndarray] = {}
    covered: list[int] = []
    pos = 0
    for n, (d, keys) in enumerate(layers):
        left = len(values) - pos
        if left == 0 and not loose:
            break
        need = sum(int(np.prod(shapes[k])) for k in keys)
        last = n == len(layers) - 1
        if loose and left < need:
            raise SwarmError(f"{source} ends inside layer {d.index} ({describe_layer(d)}) in the middle of a value: "
                             f"it needs {need} values ({_shapes(keys, shapes)}), the file has {left} and {loose} "
                             "bytes left (a copy cut short?)")
        if last and left != need:
            raise SwarmError(_last_layer_mismatch(source, desc, d, keys, shapes, left, need))
        if left < need:
            raise SwarmError(f"{source} ends inside layer {d.index} ({describe_layer(d)}): it needs {need} values "
                             f"({_shapes(keys, shapes)}), the file has {left} left")
        for key in keys:
            shape = shapes[key]
            count = int(np.prod(shape))
            array = values[pos:pos + count]
            if transpose and key.endswith(".fc.weight"):
                array = array.reshape(shape[1], shape[0]).T
            tensors[key] = np.array(array, dtype=np.float32).reshape(shape)
            pos += count
        var = next((k for k in keys if k.endswith("running_var")), None)
        if var is not None and not (np.isfinite(tensors[var]).all() and (tensors[var] >= 0).all()):
            raise SwarmError(f"{source} does not fit {desc.name} at layer {d.index} ({describe_layer(d)}): the values "
                             "read as its BatchNorm variances are negative or not finite, so the file holds a "
                             "different network from there on")
        covered.append(d.index)
    if loose and pos == len(values):
        raise SwarmError(f"{source} goes on {loose} bytes after the last layer with weights, {layers[-1][0].index} "
                         f"({describe_layer(layers[-1][0])}): less than a value, so not weights written for "
                         f"{desc.name}")
    return DarknetWeights(tensors, covered, len(layers), (major, minor, revision), int(seen))


def describe_layer(d: LayerDesc) -> str:
    if d.kind == "conv":
        text = f"[convolutional] {d.kernel}x{d.kernel} {d.in_shape[0]}->{d.out_shape[0]}"
    else:
        text = f"[connected] {d.in_shape[0] * d.in_shape[1] * d.in_shape[2]}->{d.out_shape[0]}"
    return text + (", batch_normalize" if d.batch_normalize else "")


def _shapes(keys: list[str], shapes: Mapping[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{k.split('.', 2)[2]} {'x'.join(map(str, shapes[k]))}" for k in keys)


def _last_layer_mismatch(source: str, desc: ModelDesc, d: LayerDesc, keys: list[str],
                         shapes: Mapping[str, tuple[int, ...]], left: int, need: int) -> str:
    """The message for a file whose values for the network's last layer are not its size,
    with the output count the file implies when it is a whole one (a different --classes)."""
    outputs = d.out_shape[0]
    per_output = need // outputs  # values per filter (or per connected output)
    where = f"layer {d.index} ({describe_layer(d)}, the last with weights)"
    if left % per_output == 0:
        weight = next(k for k in keys if k.endswith("weight") and ".bn." not in k)
        theirs = (left // per_output,) + tuple(shapes[weight][1:])
        return (f"{source} does not fit {desc.name} at {where}: the file's weights there are "
                f"{'x'.join(map(str, theirs))}, the model's {'x'.join(map(str, shapes[weight]))} (another class "
                "count, or another network; give --classes to match, or load a backbone file without this layer)")
    more = "more" if left > need else "fewer"
    return (f"{source} does not fit {desc.name} at {where}: the layer needs {need} values "
            f"({_shapes(keys, shapes)}), the file has {left} ({more}): it was written for a different network")


def darknet_cfg(text: str, desc: ModelDesc, source: str = "<cfg>") -> tuple[str, list[str]]:
    """The .cfg text for exported weights: `text` with [net] width/height set to the trained
    size; the last layer's filters/output, the [region]'s classes and each [yolo]'s (with the
    filters of the conv before it) set to the trained class count; [region] softmax=1 (the
    class scores' softmax, which darknet applies only when told); and the anchors of every
    head to those the network was trained with (scaled from the file's own size: read back at
    the size the file now gives, they are not scaled again); and a [shortcut] that adds a
    larger map with the subsampling as layers of its own (darknet_shortcuts). The rest of
    the file, comments included, unchanged. And notes on what darknet itself reads differently."""
    sections = parse_cfg(text, source)
    layer_sections = sections[1:1 + len(desc.layers)]
    edits: list[tuple[int, str, str]] = [(0, "width", str(desc.img_size.width)),
                                            (0, "height", str(desc.img_size.height))]
    last = max(d.index for d, _ in weighted_layers(desc))
    key = "filters" if desc.layers[last].kind == "conv" else "output"
    edits.append((1 + last, key, str(desc.layers[last].out_shape[0])))
    for head in desc.extra.get("heads") or []:  # each [yolo]: its classes, its anchors at the trained size,
        n = 1 + head["layer"]                    # and the conv before it sized for them
        edits.append((n, "classes", str(head["classes"])))
        edits.append((n, "anchors", ", ".join(f"{v:.6g}" for anchor in head["anchors"] for v in anchor)))
        if sections[n - 1].name == "convolutional":
            edits.append((n - 1, "filters", str(desc.layers[head["layer"] - 1].out_shape[0])))
    region = next((n for n, s in enumerate(sections) if s.name == "region"), None)
    if region is not None:
        edits.append((region, "classes", str(desc.extra["classes"])))
        edits.append((region, "softmax", "1"))  # darknet's default is none: its readers would take raw class scores
        edits.append((region, "anchors", ", ".join(f"{v:.6g}" for anchor in desc.extra["anchors"] for v in anchor)))
    notes = [f"{s.where()}: size= makes a local average pool in swarm; darknet's [avgpool] is always global"
             for s in layer_sections if s.name == "avgpool" and "size" in s.options]
    notes += [f"{layer_sections[layer].where()}: adds layer {src}'s map, {sample} times smaller, at stride {sample} as "
              "darknet's shortcut_cpu does; AlexeyAB's darknet and OpenCV's reader add maps of one size only"
              for layer, src, _, sample in resized_shortcut_inputs(desc) if sample > 1]

    return with_explicit_subsampling(set_options(text, sections, edits), desc, source), notes
