"""Turning parsed darknet sections into a torch network and its per-layer description.

Shapes are inferred first, without torch, so that a bad .cfg or an image size the
network cannot take is reported before anything is allocated. Shapes are (C, H, W); sizes
in messages are written W x H, as --img-size is.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from planner.image_size import ImageSize
from planner.model_desc import LayerDesc, ModelDesc
from swarm.errors import SwarmError
from swarm.zoo.darknet import Section

ACTIVATIONS = ("leaky", "linear", "relu", "logistic", "tanh", "mish", "swish", "relu6", "hard_mish", "gelu")


@dataclass
class LayerPlan:
    """Everything needed to make one layer's torch module (kept apart from torch so that
    shape inference stays cheap and pure)."""

    desc: LayerDesc
    section: Section
    in_features: int = 0  # connected: flattened input size
    out_features: int = 0
    probability: float = 0.0  # dropout
    options: dict = field(default_factory=dict)  # upsample: scale; crop: flip, adjust


def _activation(section: Section, default: str = "logistic") -> str:
    act = section.get_str("activation", default)  # darknet's default is logistic for conv and connected
    if act not in ACTIVATIONS:
        raise SwarmError(f"{section.where()}: activation '{act}' is not supported; use one of {', '.join(ACTIVATIONS)}")
    return act


def _act_flops(act: str, elems: int) -> int:
    return 0 if act == "linear" else elems * (1 if act in ("leaky", "relu", "relu6") else 4)


def _conv_out(size: int, kernel: int, stride: int, pad_total: int) -> int:
    return (size + pad_total - kernel) // stride + 1


def _sources(sec: Section, key: str, i: int) -> list[int]:
    """The layers a `layers=`/`from=` list names (negative: counted back from this one)."""
    srcs = []
    for ref in sec.get_ints(key):
        src = i + ref if ref < 0 else ref
        if not 0 <= src < i:
            raise SwarmError(f"{sec.where()}: {key}={ref} refers to layer {src}, which is not an earlier layer")
        srcs.append(src)
    return srcs


def _one_source(sec: Section, i: int) -> int:
    """The one layer a `from=` names ([scale_channels], [sam] multiply by a single map)."""
    srcs = _sources(sec, "from", i)
    if len(srcs) != 1:
        raise SwarmError(f"{sec.where()}: from= names {len(srcs)} layers; [{sec.name}] multiplies by one")
    return srcs[0]


@dataclass
class _Walk:
    """The shape walk through a .cfg's layers: what has been inferred so far."""

    img_size: ImageSize
    native: ImageSize  # the [net] size: [crop] windows keep their share of it
    classes: int | None  # --classes, resizing the layers that feed the heads
    plans: list[LayerPlan] = field(default_factory=list)
    shapes: list[tuple[int, int, int]] = field(default_factory=list)
    flat: list[bool] = field(default_factory=list)  # after a [connected] layer activations are vectors
    yolo: list[dict] = field(default_factory=list)

    def add(self, desc: LayerDesc, sec: Section, flat: bool = False, **kw) -> None:
        self.plans.append(LayerPlan(desc, sec, **kw))
        self.shapes.append(desc.out_shape)
        self.flat.append(flat)

    def maps(self, sec: Section, srcs: list[int]) -> list[tuple[int, int, int]]:
        if any(self.flat[s] for s in srcs if s >= 0):
            raise SwarmError(f"{sec.where()}: [{sec.name}] cannot take the output of a [connected] layer")
        return [self.shapes[s] for s in srcs]


def infer_layers(sections: list[Section], img_size: ImageSize, in_channels: int,
                 classes_override: int | None = None) -> tuple[list[LayerPlan], dict, tuple[int, ...]]:
    """Walk the layer sections, computing every layer's shapes, parameters and FLOPs.

    Returns the layer plans, the loss head description ({"loss": "region", ...},
    {"loss": "yolo", "heads": [...]}, ...) and the layers the loss reads. Raises SwarmError
    naming the section when a shape does not work."""
    from swarm.zoo.heads import HEAD_SECTIONS

    body = sections[1:]
    head_sections = [s for s in body if s.name in HEAD_SECTIONS]
    layer_sections = [s for s in body if s.name not in HEAD_SECTIONS]
    if head_sections and body[-len(head_sections):] != head_sections:
        raise SwarmError(f"{head_sections[0].where()}: [region]/[detection]/[softmax]/[cost] must be the last sections")
    if not any(s.name in ("convolutional", "connected") for s in layer_sections):
        raise SwarmError(f"{sections[0].source}: the network has no [convolutional] or [connected] layer")
    net = sections[0]
    width = net.get_int("width", 416)
    walk = _Walk(img_size, ImageSize(max(width, 1), max(net.get_int("height", width), 1)), classes_override)
    head = _head(head_sections, classes_override)
    resized = _resized_outputs(layer_sections, head, classes_override)
    c, h, w = in_channels, *img_size.hw
    for i, sec in enumerate(layer_sections):
        prev = (c, h, w) if i == 0 else walk.shapes[i - 1]
        flat = bool(walk.flat[-1]) if walk.flat else False
        LAYER_KINDS[sec.name](walk, sec, i, prev, flat, resized.get(i))
        _refuse_unknown(sec)
    return _finish(walk, head, head_sections)


def _head(head_sections: list[Section], classes_override: int | None) -> dict:
    from swarm.zoo.heads import detection_head, region_head

    for sec in head_sections:
        if sec.name == "region":
            return region_head(sec, classes_override)
        if sec.name == "detection":
            return detection_head(sec, classes_override)
    return {"loss": "softmax"}


def _resized_outputs(layer_sections: list[Section], head: dict, classes: int | None) -> dict[int, int]:
    """With --classes, the output size of each layer that feeds a head: the conv before each
    [yolo], the last conv of a [region] network, the last [connected] of a [detection]
    network, the last layer with weights of a classifier."""
    if classes is None:
        return {}
    from swarm.zoo.heads import detection_outputs

    out = {}
    for i, sec in enumerate(layer_sections):
        if sec.name == "yolo" and i > 0 and layer_sections[i - 1].name == "convolutional":
            mask = sec.options.get("mask")
            count = len([m for m in mask.split(",") if m.strip()]) if mask else int(sec.options.get("num", "1"))
            out[i - 1] = count * (5 + classes)
    if out:
        return out
    last = max(i for i, s in enumerate(layer_sections) if s.name in ("convolutional", "connected"))
    if head["loss"] == "region":
        out[last] = head["num"] * (5 + head["classes"])
    elif head["loss"] == "detection":
        out[last] = detection_outputs(head)
    else:
        out[last] = classes
    return out


def _refuse_unknown(sec: Section) -> None:
    from swarm.zoo.heads import refuse_unknown

    refuse_unknown(sec)


def _conv(walk: _Walk, sec: Section, i: int, prev, flat: bool, resized: int | None) -> None:
    if flat:
        raise SwarmError(f"{sec.where()}: a [convolutional] layer cannot follow a [connected] layer")
    c, h, w = prev
    filters = sec.get_int("filters")
    filters = resized or filters
    size = sec.get_int("size", 1)
    stride = sec.get_int("stride", 1)
    sy, sx = sec.get_int("stride_y", stride), sec.get_int("stride_x", stride)
    pad = sec.get_int("padding", 0)
    if sec.get_int("pad", 0):
        pad = size // 2
    dilation = sec.get_int("dilation", 1)
    groups = sec.get_int("groups", 1)
    bn = bool(sec.get_int("batch_normalize", 0))
    act = _activation(sec)
    if filters <= 0 or size <= 0 or sy <= 0 or sx <= 0 or pad < 0 or dilation <= 0 or groups <= 0:
        raise SwarmError(f"{sec.where()}: filters, size, stride, dilation and groups must be positive and padding not negative")
    if c % groups or filters % groups:
        raise SwarmError(f"{sec.where()}: groups={groups} must divide the {c} input channels and the {filters} filters")
    span = dilation * (size - 1) + 1
    oh, ow = _conv_out(h, span, sy, 2 * pad * dilation), _conv_out(w, span, sx, 2 * pad * dilation)
    if oh < 1 or ow < 1:
        raise _too_small(sec, walk.img_size, prev)
    params = c // groups * size * size * filters + (2 * filters if bn else filters)
    out_elems = filters * oh * ow
    flops = 2 * c // groups * size * size * out_elems + (4 * out_elems if bn else out_elems) + _act_flops(act, out_elems)
    p = pad * dilation
    walk.add(LayerDesc(i, "conv", prev, (filters, oh, ow), (i - 1,), size, sy, (p, p, p, p), bn, act, params, flops,
                       groups=groups, dilation=dilation, stride_x=0 if sx == sy else sx), sec)


def _maxpool(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    if flat:
        raise SwarmError(f"{sec.where()}: [maxpool] cannot follow a [connected] layer")
    c, h, w = prev
    stride = sec.get_int("stride", 1)
    sy, sx = sec.get_int("stride_y", stride), sec.get_int("stride_x", stride)
    size = sec.get_int("size", stride)
    padding = sec.get_int("padding", size - 1)
    if size <= 0 or sy <= 0 or sx <= 0 or padding < 0:
        raise SwarmError(f"{sec.where()}: size and stride must be positive and padding not negative")
    oh, ow = _conv_out(h, size, sy, padding), _conv_out(w, size, sx, padding)
    if oh < 1 or ow < 1:
        raise _too_small(sec, walk.img_size, prev)
    lo = padding // 2  # darknet offsets windows by -padding/2, the rest pads the far side
    hi_h = max(0, (oh - 1) * sy + size - lo - h)
    hi_w = max(0, (ow - 1) * sx + size - lo - w)
    walk.add(LayerDesc(i, "maxpool", prev, (c, oh, ow), (i - 1,), size, sy, (lo, hi_w, lo, hi_h),
                       flops=size * size * c * oh * ow, stride_x=0 if sx == sy else sx), sec)


def _avgpool(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    if flat:
        raise SwarmError(f"{sec.where()}: [avgpool] cannot follow a [connected] layer")
    c, h, w = prev
    if "size" in sec.options:  # local average pooling (a swarm extension)
        size = sec.get_int("size")
        stride = sec.get_int("stride", size)
        oh, ow = _conv_out(h, size, stride, 0), _conv_out(w, size, stride, 0)
        if oh < 1 or ow < 1:
            raise _too_small(sec, walk.img_size, prev)
        walk.add(LayerDesc(i, "avgpool", prev, (c, oh, ow), (i - 1,), size, stride, flops=size * size * c * oh * ow), sec)
    else:  # darknet's [avgpool] is global
        walk.add(LayerDesc(i, "avgpool", prev, (c, 1, 1), (i - 1,), 0, 0, flops=c * h * w), sec)


def _route(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    srcs = _sources(sec, "layers", i)
    groups, group_id = sec.get_int("groups", 1), sec.get_int("group_id", 0)
    if groups < 1 or not 0 <= group_id < groups:
        raise SwarmError(f"{sec.where()}: group_id={group_id} must be from 0 to groups-1 with groups={groups} at least 1")
    src_shapes = [walk.shapes[s] for s in srcs]
    if len(srcs) == 1 and walk.flat[srcs[0]]:  # a vector passed on as it is
        if groups > 1:
            raise SwarmError(f"{sec.where()}: cannot take channel groups of a [connected] layer's output")
        walk.add(LayerDesc(i, "route", src_shapes[0], src_shapes[0], tuple(srcs)), sec, flat=True)
        return
    if any(walk.flat[s] for s in srcs):
        raise SwarmError(f"{sec.where()}: cannot concatenate the output of a [connected] layer")
    if len({(sh[1], sh[2]) for sh in src_shapes}) != 1:
        sizes = ", ".join(f"layer {s}: {sh[2]}x{sh[1]}" for s, sh in zip(srcs, src_shapes))
        raise _route_mismatch(sec, walk.img_size, sizes)
    for s, sh in zip(srcs, src_shapes):
        if sh[0] % groups:
            raise SwarmError(f"{sec.where()}: groups={groups} does not divide layer {s}'s {sh[0]} channels")
    c = sum(sh[0] // groups for sh in src_shapes)
    walk.add(LayerDesc(i, "route", src_shapes[0], (c, src_shapes[0][1], src_shapes[0][2]), tuple(srcs),
                       groups=groups, group_id=group_id), sec)


def _shortcut(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    if i == 0:
        raise SwarmError(f"{sec.where()}: [shortcut] cannot be the first layer")
    srcs = _sources(sec, "from", i)
    for key in ("weights_type", "weights_normalization"):
        if sec.get_str(key, "none") != "none":
            raise SwarmError(f"{sec.where()}: {key}={sec.get_str(key, 'none')} is not supported; swarm adds the maps "
                             "unweighted (weights_type=none)")
    act = _activation(sec, "linear")
    shapes = walk.maps(sec, [i - 1, *srcs])
    for s, sh in zip(srcs, shapes[1:]):
        if shortcut_ratio(sh, prev) is None:
            raise SwarmError(f"{sec.where()}: layer {s}'s {sh[2]}x{sh[1]} map cannot be added to the {prev[2]}x{prev[1]} "
                             f"map before it at image size {walk.img_size} (one must be a whole multiple of the "
                             "other, alike on both axes)")
    elems = prev[0] * prev[1] * prev[2]
    walk.add(LayerDesc(i, "shortcut", prev, prev, (i - 1, *srcs), activation=act,
                       flops=elems * len(srcs) + _act_flops(act, elems)), sec)


def shortcut_ratio(added: tuple[int, int, int], out: tuple[int, int, int]) -> tuple[int, int] | None:
    """How darknet adds a map of another shape (its shortcut_cpu): over the channels both
    have, the larger map's pixels taken every `stride`-th to the smaller one's, or the smaller
    one's added at every `sample`-th pixel of the larger. (stride, sample), or None when the
    sizes are not whole multiples alike on both axes."""
    (_, h1, w1), (_, h2, w2) = added, out
    if h1 >= h2 and w1 >= w2:
        ok = h1 % h2 == 0 and w1 % w2 == 0 and h1 // h2 == w1 // w2
        return (w1 // w2, 1) if ok else None
    if h2 >= h1 and w2 >= w1:
        ok = h2 % h1 == 0 and w2 % w1 == 0 and h2 // h1 == w2 // w1
        return (1, w2 // w1) if ok else None
    return None


def _upsample(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    walk.maps(sec, [i - 1] if i else [])
    stride = sec.get_int("stride", 2)
    scale = sec.get_float("scale", 1.0)
    if stride < 1:
        raise SwarmError(f"{sec.where()}: stride={stride}: swarm's [upsample] enlarges (a positive stride)")
    c, h, w = prev
    if h * stride > 4 * MAX_MAP or w * stride > 4 * MAX_MAP:
        raise SwarmError(f"{sec.where()}: a {w}x{h} map upsampled by {stride} is larger than swarm takes")
    walk.add(LayerDesc(i, "upsample", prev, (c, h * stride, w * stride), (i - 1,), stride=stride,
                       flops=c * h * w * stride * stride), sec, options={"scale": scale})


def _scale_channels(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    src = _one_source(sec, i)
    if sec.get_int("scale_wh", 0):
        raise SwarmError(f"{sec.where()}: scale_wh=1 is not supported; swarm scales channels (scale_wh=0)")
    act = _activation(sec, "linear")
    (c, h, w), (sc, sh, sw) = walk.maps(sec, [i - 1, src])
    if (h, w) != (1, 1) or c != sc:
        raise SwarmError(f"{sec.where()}: scales layer {src}'s {sc} channels by a {c}x{w}x{h} map; it needs {sc}x1x1")
    walk.add(LayerDesc(i, "scale_channels", (sc, sh, sw), (sc, sh, sw), (i - 1, src), activation=act,
                       flops=sc * sh * sw + _act_flops(act, sc * sh * sw)), sec)


def _sam(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    src = _one_source(sec, i)
    act = _activation(sec, "linear")
    shapes = walk.maps(sec, [i - 1, src])
    if shapes[0] != shapes[1]:
        raise SwarmError(f"{sec.where()}: multiplies layer {src}'s map by the one before it; their shapes differ "
                         f"({shapes[1]} against {shapes[0]}, channels, height, width)")
    elems = shapes[0][0] * shapes[0][1] * shapes[0][2]
    walk.add(LayerDesc(i, "sam", shapes[1], shapes[1], (i - 1, src), activation=act,
                     flops=elems + _act_flops(act, elems)), sec)


def _crop(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    if flat:
        raise SwarmError(f"{sec.where()}: [crop] cannot follow a [connected] layer")
    c, h, w = prev
    ch, cw = sec.get_int("crop_height", 1), sec.get_int("crop_width", 1)
    flip = bool(sec.get_int("flip", 0))
    adjust = not sec.get_int("noadjust", 0)
    # darknet keeps a crop's share of the [net] size when the network is resized
    oh = max(1, round(ch * walk.img_size.height / walk.native.height))
    ow = max(1, round(cw * walk.img_size.width / walk.native.width))
    if ch < 1 or cw < 1:
        raise SwarmError(f"{sec.where()}: crop_height and crop_width must be at least 1")
    if oh > h or ow > w:
        raise SwarmError(f"{sec.where()}: a {ow}x{oh} window does not fit the {w}x{h} map at image size {walk.img_size}")
    walk.add(LayerDesc(i, "crop", prev, (c, oh, ow), (i - 1,), flops=c * oh * ow), sec,
             options={"flip": flip, "adjust": adjust})


def _reorg(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    c, h, w = prev
    stride = sec.get_int("stride", 2)
    if flat or stride < 1 or h % stride or w % stride:
        raise SwarmError(
            f"{sec.where()}: reorg with stride {stride} needs a map size divisible by {stride}, "
            f"got {w}x{h} at image size {walk.img_size}")
    walk.add(LayerDesc(i, "reorg", prev, (c * stride * stride, h // stride, w // stride), (i - 1,),
                       stride=stride, flops=c * h * w), sec)


def _connected(walk: _Walk, sec: Section, i: int, prev, flat: bool, resized: int | None) -> None:
    out = sec.get_int("output")
    out = resized or out
    if out <= 0:
        raise SwarmError(f"{sec.where()}: output must be positive")
    bn = bool(sec.get_int("batch_normalize", 0))
    act = _activation(sec)
    n_in = prev[0] * prev[1] * prev[2]
    params = n_in * out + (2 * out if bn else out)
    walk.add(LayerDesc(i, "connected", prev, (out, 1, 1), (i - 1,), batch_normalize=bn, activation=act,
                       params=params, flops=2 * n_in * out + 4 * out), sec, flat=True, in_features=n_in, out_features=out)


def _dropout(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    p = sec.get_float("probability", 0.5)
    if not 0.0 <= p < 1.0:
        raise SwarmError(f"{sec.where()}: probability={p} must be in [0, 1)")
    walk.add(LayerDesc(i, "dropout", prev, prev, (i - 1,), flops=prev[0] * prev[1] * prev[2]), sec, flat=flat,
             probability=p)


def _yolo(walk: _Walk, sec: Section, i: int, prev, flat: bool, _resized) -> None:
    from swarm.zoo.heads import yolo_head

    walk.maps(sec, [i - 1] if i else [])
    head = yolo_head(sec, i, walk.classes)
    want = len(head["mask"]) * (5 + head["classes"])
    if prev[0] != want:
        raise SwarmError(f"{sec.where()}: the layer before gives {prev[0]} channels, but mask's {len(head['mask'])} "
                         f"anchors x (5 + classes={head['classes']}) needs {want}")
    head["grid"] = prev[1:]
    walk.yolo.append(head)
    walk.add(LayerDesc(i, "yolo", prev, prev, (i - 1,)), sec)


LAYER_KINDS = {"convolutional": _conv, "maxpool": _maxpool, "avgpool": _avgpool, "route": _route,
               "shortcut": _shortcut, "upsample": _upsample, "scale_channels": _scale_channels, "sam": _sam,
               "crop": _crop, "reorg": _reorg, "connected": _connected, "dropout": _dropout, "yolo": _yolo}
MAX_MAP = 2048


def _stride_of(img_size: ImageSize, grid: tuple[int, int]) -> int | None:
    """Pixels per cell of a head's grid, when whole and alike on both axes."""
    (h, w) = grid
    sy, sx = divmod(img_size.height, h), divmod(img_size.width, w)
    return sx[0] if sx == sy and sx[1] == 0 else None


def _finish(walk: _Walk, head: dict, head_sections: list[Section]) -> tuple[list[LayerPlan], dict, tuple[int, ...]]:
    last = len(walk.plans) - 1
    c, h, w = walk.shapes[last]
    flat = walk.flat[last]
    if walk.yolo:
        if head["loss"] != "softmax" or head_sections:
            raise SwarmError(f"{head_sections[0].where()}: a network with [yolo] heads ends in them, "
                             f"not in [{head_sections[0].name}]")
        classes = {y["classes"] for y in walk.yolo}
        if len(classes) != 1:
            raise SwarmError(f"{walk.plans[walk.yolo[0]['layer']].section.where()}: the [yolo] heads predict "
                             f"different numbers of classes ({', '.join(map(str, sorted(classes)))})")
        strides = [_stride_of(walk.img_size, y["grid"]) for y in walk.yolo]
        for y in walk.yolo:
            y["stride"] = _stride_of(walk.img_size, y["grid"])
        head = {"loss": "yolo", "classes": classes.pop(), "img_wh": (walk.img_size.width, walk.img_size.height),
                "heads": walk.yolo, "stride": None if None in strides else max(strides)}
        return walk.plans, head, tuple(y["layer"] for y in walk.yolo)
    if head["loss"] == "region":
        region = next(s for s in head_sections if s.name == "region")
        want = head["num"] * (5 + head["classes"])
        if c != want or flat:
            raise SwarmError(
                f"{region.where()}: the last layer gives {c} channels, but num={head['num']} anchors x "
                f"(5 + classes={head['classes']}) needs {want}")
        head["grid"] = (h, w)
        head["stride"] = _stride_of(walk.img_size, (h, w))
    elif head["loss"] == "detection":
        from swarm.zoo.heads import detection_outputs

        sec = next(s for s in head_sections if s.name == "detection")
        if c * h * w != detection_outputs(head):
            raise SwarmError(f"{sec.where()}: the last layer gives {c * h * w} values, but side={head['side']}, "
                             f"num={head['num']} and classes={head['classes']} need {detection_outputs(head)}")
    else:
        head["classes"] = c * h * w
    return walk.plans, head, (last,)


def _too_small(sec: Section, img_size: ImageSize, shape) -> SwarmError:
    return SwarmError(f"{sec.where()}: input {shape[2]}x{shape[1]} is too small for this layer at image size {img_size}")


def _route_mismatch(sec: Section, img_size: ImageSize, sizes: str) -> SwarmError:
    return SwarmError(f"{sec.where()}: routed maps differ in size at image size {img_size} ({sizes})")


def describe(name: str, sections: list[Section], img_size: ImageSize, classes: int | None = None) -> tuple[ModelDesc, list[LayerPlan]]:
    from swarm.zoo.heads import refuse_unknown

    net = sections[0]
    in_channels = net.get_int("channels", 3)
    plans, head, outputs = infer_layers(sections, img_size, in_channels, classes)
    refuse_unknown(net)  # darknet's training hyper-parameters are accepted: swarm's own flags set them
    desc = ModelDesc(name, img_size, in_channels, tuple(p.desc for p in plans), head["loss"], head, outputs)
    return desc, plans


def make_modules(plans: list[LayerPlan], only: range | None = None):
    """The torch modules, one per layer, named so that state_dict keys read well
    (`layers.0.conv.weight`, `layers.0.bn.running_mean`, `layers.20.fc.weight`).

    With `only`, layers outside that range are empty placeholders: a device running one
    stage allocates just that stage's weights, under the same state_dict keys."""
    from torch import nn

    from swarm.zoo.layers import (Crop, MaxPool2d, Reorg, Route, ScaleChannels, Shortcut, Upsample, Weighted,
                                  activation)

    modules = []
    for plan in plans:
        d = plan.desc
        if only is not None and d.index not in only:
            modules.append(nn.Identity())
        elif d.kind == "conv":
            stride = (d.stride, d.stride_x or d.stride)
            parts = OrderedDict(conv=nn.Conv2d(d.in_shape[0], d.out_shape[0], d.kernel, stride, d.padding[0],
                                               dilation=d.dilation, groups=d.groups, bias=not d.batch_normalize))
            if d.batch_normalize:
                parts["bn"] = nn.BatchNorm2d(d.out_shape[0])
            parts["act"] = activation(d.activation)
            modules.append(Weighted(parts))
        elif d.kind == "maxpool":
            parts = OrderedDict()
            if any(d.padding):
                parts["pad"] = nn.ConstantPad2d(d.padding, float("-inf"))
            parts["pool"] = MaxPool2d(d.kernel, (d.stride, d.stride_x or d.stride))
            modules.append(nn.Sequential(parts))
        elif d.kind == "avgpool":
            pool = nn.AdaptiveAvgPool2d(1) if d.kernel == 0 else nn.AvgPool2d(d.kernel, d.stride)
            modules.append(nn.Sequential(OrderedDict(pool=pool)))
        elif d.kind == "connected":
            parts = OrderedDict(fc=nn.Linear(plan.in_features, plan.out_features, bias=not d.batch_normalize))
            if d.batch_normalize:
                parts["bn"] = nn.BatchNorm1d(plan.out_features)
            parts["act"] = activation(d.activation)
            modules.append(Weighted(parts))
        elif d.kind == "route":
            modules.append(Route(d.groups, d.group_id))
        elif d.kind == "shortcut":
            modules.append(Shortcut(d.activation))
        elif d.kind in ("scale_channels", "sam"):
            modules.append(ScaleChannels(d.activation))
        elif d.kind == "upsample":
            modules.append(Upsample(d.stride, plan.options["scale"]))
        elif d.kind == "crop":
            modules.append(Crop(d.out_shape[1:], plan.options["flip"], plan.options["adjust"]))
        elif d.kind == "reorg":
            modules.append(Reorg(d.stride))
        elif d.kind in ("dropout", "yolo"):
            modules.append(nn.Identity())
        else:  # pragma: no cover
            raise AssertionError(d.kind)
    return modules
