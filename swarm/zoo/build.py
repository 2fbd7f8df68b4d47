"""Turning parsed darknet sections into a torch network and its per-layer description.

Shapes are inferred first, without torch, so that a bad .cfg or an image size the
network cannot take is reported before anything is allocated. Shapes are (C, H, W); sizes
in messages are written W x H, as --img-size is.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from planner.image_size import ImageSize
from planner.model_desc import LayerDesc, ModelDesc
from swarm.errors import SwarmError
from swarm.zoo.darknet import Section

ACTIVATIONS = ("leaky", "linear", "relu", "logistic", "tanh")


@dataclass
class LayerPlan:
    """Everything needed to make one layer's torch module (kept apart from torch so that
    shape inference stays cheap and pure)."""

    desc: LayerDesc
    section: Section
    in_features: int = 0  # connected: flattened input size
    out_features: int = 0
    probability: float = 0.0  # dropout


def _activation(section: Section) -> str:
    act = section.get_str("activation", "logistic")  # darknet's default
    if act not in ACTIVATIONS:
        raise SwarmError(f"{section.where()}: activation '{act}' is not supported; use one of {', '.join(ACTIVATIONS)}")
    return act


def _conv_out(size: int, kernel: int, stride: int, pad_total: int) -> int:
    return (size + pad_total - kernel) // stride + 1


def infer_layers(sections: list[Section], img_size: ImageSize, in_channels: int,
                 classes_override: int | None = None) -> tuple[list[LayerPlan], dict]:
    """Walk the layer sections, computing every layer's shapes, parameters and FLOPs.

    Returns the layer plans and the loss head description ({"loss": "region", ...} or
    {"loss": "softmax"}). Raises SwarmError naming the section when a shape does not work.
    """
    body = sections[1:]
    head_sections = [s for s in body if s.name in ("region", "softmax", "cost")]
    layer_sections = [s for s in body if s.name not in ("region", "softmax", "cost")]
    if head_sections and body[-len(head_sections):] != head_sections:
        raise SwarmError(f"{head_sections[0].where()}: [region]/[softmax]/[cost] must be the last sections")
    region = next((s for s in head_sections if s.name == "region"), None)
    head: dict
    if region is not None:
        num = region.get_int("num", 5)
        classes = region.get_int("classes", 20)
        if classes_override is not None:
            classes = classes_override
        anchors = region.get_floats("anchors")
        if len(anchors) != 2 * num:
            raise SwarmError(f"{region.where()}: {len(anchors)} anchor values given, need 2 x num = {2 * num}")
        if region.get_int("coords", 4) != 4:
            raise SwarmError(f"{region.where()}: only coords=4 is supported")
        head = {
            "loss": "region",
            "classes": classes,
            "num": num,
            "anchors": [(anchors[2 * i], anchors[2 * i + 1]) for i in range(num)],
            "object_scale": region.get_float("object_scale", 5.0),
            "noobject_scale": region.get_float("noobject_scale", 1.0),
            "class_scale": region.get_float("class_scale", 1.0),
            "coord_scale": region.get_float("coord_scale", 1.0),
            "thresh": region.get_float("thresh", 0.6),
            "rescore": bool(region.get_int("rescore", 0)),
        }
    else:
        head = {"loss": "softmax"}

    # With a class-count override the last layer with weights is resized to match.
    last_weighted = max((i for i, s in enumerate(layer_sections) if s.name in ("convolutional", "connected")), default=None)
    if last_weighted is None:
        raise SwarmError(f"{sections[0].source}: the network has no [convolutional] or [connected] layer")

    plans: list[LayerPlan] = []
    shapes: list[tuple[int, int, int]] = []
    c, (h, w) = in_channels, img_size.hw
    flat = False  # after a [connected] layer activations are vectors
    for i, sec in enumerate(layer_sections):
        prev = i - 1
        inputs: tuple[int, ...] = (prev,)
        in_shape = (c, h, w)
        if sec.name == "convolutional":
            if flat:
                raise SwarmError(f"{sec.where()}: a [convolutional] layer cannot follow a [connected] layer")
            filters = sec.get_int("filters")
            if i == last_weighted and classes_override is not None:
                filters = head["num"] * (5 + head["classes"]) if head["loss"] == "region" else classes_override
            size = sec.get_int("size", 1)
            stride = sec.get_int("stride", 1)
            pad = sec.get_int("padding", 0)
            if sec.get_int("pad", 0):
                pad = size // 2
            bn = bool(sec.get_int("batch_normalize", 0))
            act = _activation(sec)
            if filters <= 0 or size <= 0 or stride <= 0 or pad < 0:
                raise SwarmError(f"{sec.where()}: filters, size and stride must be positive and padding not negative")
            oh, ow = _conv_out(h, size, stride, 2 * pad), _conv_out(w, size, stride, 2 * pad)
            if oh < 1 or ow < 1:
                raise _too_small(sec, img_size, (c, h, w))
            params = c * size * size * filters + (2 * filters if bn else filters)
            out_elems = filters * oh * ow
            flops = 2 * c * size * size * out_elems + (4 * out_elems if bn else out_elems)
            flops += 0 if act == "linear" else out_elems
            desc = LayerDesc(i, "conv", in_shape, (filters, oh, ow), inputs, size, stride,
                             (pad, pad, pad, pad), bn, act, params, flops)
            c, h, w = filters, oh, ow
            plans.append(LayerPlan(desc, sec))
        elif sec.name == "maxpool":
            if flat:
                raise SwarmError(f"{sec.where()}: [maxpool] cannot follow a [connected] layer")
            stride = sec.get_int("stride", 1)
            size = sec.get_int("size", stride)
            padding = sec.get_int("padding", size - 1)
            if size <= 0 or stride <= 0 or padding < 0:
                raise SwarmError(f"{sec.where()}: size and stride must be positive and padding not negative")
            oh, ow = _conv_out(h, size, stride, padding), _conv_out(w, size, stride, padding)
            if oh < 1 or ow < 1:
                raise _too_small(sec, img_size, (c, h, w))
            lo = padding // 2  # darknet offsets windows by -padding/2, the rest pads the far side
            hi_h = max(0, (oh - 1) * stride + size - lo - h)
            hi_w = max(0, (ow - 1) * stride + size - lo - w)
            desc = LayerDesc(i, "maxpool", in_shape, (c, oh, ow), inputs, size, stride,
                             (lo, hi_w, lo, hi_h), flops=size * size * c * oh * ow)
            h, w = oh, ow
            plans.append(LayerPlan(desc, sec))
        elif sec.name == "avgpool":
            if flat:
                raise SwarmError(f"{sec.where()}: [avgpool] cannot follow a [connected] layer")
            if "size" in sec.options:  # local average pooling (a swarm extension)
                stride = sec.get_int("stride", sec.get_int("size"))
                size = sec.get_int("size")
                oh, ow = _conv_out(h, size, stride, 0), _conv_out(w, size, stride, 0)
                if oh < 1 or ow < 1:
                    raise _too_small(sec, img_size, (c, h, w))
                desc = LayerDesc(i, "avgpool", in_shape, (c, oh, ow), inputs, size, stride,
                                 flops=size * size * c * oh * ow)
                h, w = oh, ow
            else:  # darknet's [avgpool] is global
                desc = LayerDesc(i, "avgpool", in_shape, (c, 1, 1), inputs, 0, 0, flops=c * h * w)
                h, w = 1, 1
            plans.append(LayerPlan(desc, sec))
        elif sec.name == "route":
            srcs = []
            for ref in sec.get_ints("layers"):
                src = i + ref if ref < 0 else ref
                if not 0 <= src < i:
                    raise SwarmError(f"{sec.where()}: layers={ref} refers to layer {src}, which is not an earlier layer")
                srcs.append(src)
            src_shapes = [shapes[s] for s in srcs]
            if any(plans[s].desc.kind == "connected" for s in srcs) and len(srcs) > 1:
                raise SwarmError(f"{sec.where()}: cannot concatenate the output of a [connected] layer")
            if len({(sh[1], sh[2]) for sh in src_shapes}) != 1:
                sizes = ", ".join(f"layer {s}: {sh[2]}x{sh[1]}" for s, sh in zip(srcs, src_shapes))
                raise _route_mismatch(sec, img_size, sizes)
            c = sum(sh[0] for sh in src_shapes)
            h, w = src_shapes[0][1], src_shapes[0][2]
            flat = plans[srcs[0]].desc.kind == "connected" if len(srcs) == 1 else False
            desc = LayerDesc(i, "route", src_shapes[0], (c, h, w), tuple(srcs))
            plans.append(LayerPlan(desc, sec))
        elif sec.name == "reorg":
            stride = sec.get_int("stride", 2)
            if stride < 1 or h % stride or w % stride:
                raise SwarmError(
                    f"{sec.where()}: reorg with stride {stride} needs a map size divisible by {stride}, "
                    f"got {w}x{h} at image size {img_size}")
            desc = LayerDesc(i, "reorg", in_shape, (c * stride * stride, h // stride, w // stride), inputs,
                             stride=stride, flops=c * h * w)
            c, h, w = c * stride * stride, h // stride, w // stride
            plans.append(LayerPlan(desc, sec))
        elif sec.name == "connected":
            out = sec.get_int("output")
            if i == last_weighted and classes_override is not None and head["loss"] == "softmax":
                out = classes_override
            if out <= 0:
                raise SwarmError(f"{sec.where()}: output must be positive")
            bn = bool(sec.get_int("batch_normalize", 0))
            act = _activation(sec)
            n_in = c * h * w
            params = n_in * out + (2 * out if bn else out)
            desc = LayerDesc(i, "connected", in_shape, (out, 1, 1), inputs, batch_normalize=bn,
                             activation=act, params=params, flops=2 * n_in * out + 4 * out)
            plans.append(LayerPlan(desc, sec, in_features=n_in, out_features=out))
            c, h, w = out, 1, 1
            flat = True
        elif sec.name == "dropout":
            p = sec.get_float("probability", 0.5)
            if not 0.0 <= p < 1.0:
                raise SwarmError(f"{sec.where()}: probability={p} must be in [0, 1)")
            desc = LayerDesc(i, "dropout", in_shape, in_shape, inputs, flops=c * h * w)
            plans.append(LayerPlan(desc, sec, probability=p))
        else:  # pragma: no cover - parse_cfg only lets known sections through
            raise SwarmError(f"{sec.where()}: unexpected section")
        shapes.append((c, h, w))
        unused = set(sec.options) - sec.used - {"type"}
        if unused:
            raise SwarmError(f"{sec.where()}: option(s) {', '.join(sorted(unused))} not understood")

    if head["loss"] == "region":
        want = head["num"] * (5 + head["classes"])
        if c != want or flat:
            raise SwarmError(
                f"{region.where()}: the last layer gives {c} channels, but num={head['num']} anchors x "
                f"(5 + classes={head['classes']}) needs {want}")
        head["grid"] = (h, w)
        sy, sx = divmod(img_size.height, h), divmod(img_size.width, w)
        head["stride"] = sx[0] if sx == sy and sx[1] == 0 else None  # pixels per cell, on both axes
    else:
        head["classes"] = c * h * w
    return plans, head


def _too_small(sec: Section, img_size: ImageSize, shape) -> SwarmError:
    return SwarmError(f"{sec.where()}: input {shape[2]}x{shape[1]} is too small for this layer at image size {img_size}")


def _route_mismatch(sec: Section, img_size: ImageSize, sizes: str) -> SwarmError:
    return SwarmError(f"{sec.where()}: routed maps differ in size at image size {img_size} ({sizes})")


def describe(name: str, sections: list[Section], img_size: ImageSize, classes: int | None = None) -> tuple[ModelDesc, list[LayerPlan]]:
    net = sections[0]
    in_channels = net.get_int("channels", 3)
    for key in ("width", "height", "batch", "subdivisions", "momentum", "decay", "learning_rate"):
        net.used.add(key)  # training hyper-parameters of darknet are set by swarm's own flags
    plans, head = infer_layers(sections, img_size, in_channels, classes)
    desc = ModelDesc(name, img_size, in_channels, tuple(p.desc for p in plans), head["loss"], head)
    return desc, plans


def make_modules(plans: list[LayerPlan], only: range | None = None):
    """The torch modules, one per layer, named so that state_dict keys read well
    (`layers.0.conv.weight`, `layers.0.bn.running_mean`, `layers.20.fc.weight`).

    With `only`, layers outside that range are empty placeholders: a device running one
    stage allocates just that stage's weights, under the same state_dict keys."""
    from torch import nn

    from swarm.zoo.layers import MaxPool2d, Reorg

    def act_module(act: str) -> nn.Module:
        # in place: the activation overwrites the map BatchNorm (or the conv) made, which
        # their backward does not read, and keeps its result, which the next layer keeps anyway
        return {"leaky": lambda: nn.LeakyReLU(0.1, inplace=True), "relu": lambda: nn.ReLU(inplace=True),
                "linear": nn.Identity, "logistic": nn.Sigmoid, "tanh": nn.Tanh}[act]()

    modules = []
    for plan in plans:
        d = plan.desc
        if only is not None and d.index not in only:
            modules.append(nn.Identity())
        elif d.kind == "conv":
            parts = OrderedDict(conv=nn.Conv2d(d.in_shape[0], d.out_shape[0], d.kernel, d.stride, d.padding[0],
                                               bias=not d.batch_normalize))
            if d.batch_normalize:
                parts["bn"] = nn.BatchNorm2d(d.out_shape[0])
            parts["act"] = act_module(d.activation)
            modules.append(nn.Sequential(parts))
        elif d.kind == "maxpool":
            parts = OrderedDict()
            if any(d.padding):
                parts["pad"] = nn.ConstantPad2d(d.padding, float("-inf"))
            parts["pool"] = MaxPool2d(d.kernel, d.stride)
            modules.append(nn.Sequential(parts))
        elif d.kind == "avgpool":
            pool = nn.AdaptiveAvgPool2d(1) if d.kernel == 0 else nn.AvgPool2d(d.kernel, d.stride)
            modules.append(nn.Sequential(OrderedDict(pool=pool)))
        elif d.kind == "connected":
            parts = OrderedDict(fc=nn.Linear(plan.in_features, plan.out_features, bias=not d.batch_normalize))
            if d.batch_normalize:
                parts["bn"] = nn.BatchNorm1d(plan.out_features)
            parts["act"] = act_module(d.activation)
            modules.append(nn.Sequential(parts))
        elif d.kind == "route":
            modules.append(nn.Identity())
        elif d.kind == "reorg":
            modules.append(Reorg(d.stride))
        elif d.kind == "dropout":
            modules.append(nn.Identity())
        else:  # pragma: no cover
            raise AssertionError(d.kind)
    return modules
