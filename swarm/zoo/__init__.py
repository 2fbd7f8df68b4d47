"""The model zoo: built-in darknet .cfg files, custom .cfg paths, and building a network.

    model, desc = build_model("yolov2-16", img_size=416, seed=1)
    model, desc = build_model("yolov2-16", img_size=ImageSize(608, 352), seed=1)   # width x height

A size is an ImageSize; an int means a square. The feature maps are H x W throughout.
"""
from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

from planner.image_size import ImageSize
from planner.model_desc import ModelDesc
from swarm.errors import SwarmError
from swarm.zoo.build import describe, make_modules
from swarm.zoo.darknet import Section, parse_cfg
from swarm.zoo.heads import darknet_only, scale_anchors

BUILTIN = ("yolov2-16", "yolov2", "yolov2-tiny", "yolov3-tiny", "yolov4-tiny", "yolov7-tiny", "darknet53", "resnet18",
           "resnet50", "mobilenetv2", "efficientnet-b0", "vgg16", "alexnet", "lenet5")
DEFAULT_MODEL = "yolov2-16"  # what `swarm train` trains without --model
# The input size a built-in model trains, plans and is evaluated at unless --img-size says
# otherwise, whatever the data (a .cfg file's own [net] size for other models; lenet5's own 32):
# small enough that the main job trains in minutes on one machine. yolov4-tiny's is 256: at
# 128 its stride-32 head sees a 4 x 4 grid, too coarse for the sample's shapes (held-out
# mAP@0.5 0.61 after 300 steps, against 0.89 at 256 and 0.96 after 450: bench/RESULTS.md).
DEFAULT_IMG_SIZE = {"yolov2-16": 128, "yolov2": 128, "yolov2-tiny": 128, "yolov3-tiny": 128, "yolov4-tiny": 256,
                    "yolov7-tiny": 128, "darknet53": 64, "resnet18": 64, "resnet50": 64, "mobilenetv2": 64,
                    "efficientnet-b0": 64, "vgg16": 64, "alexnet": 96}


MAX_IMG_SIZE = 2048  # on each side


def default_img_size(model: str, img_size: ImageSize | int | None) -> ImageSize | None:
    """`img_size`, or the size `model` takes by default (None: the model's own)."""
    if img_size is not None:
        return ImageSize.of(img_size)
    side = DEFAULT_IMG_SIZE.get(model)
    return None if side is None else ImageSize(side, side)


def model_source(model: str) -> tuple[str, str, str]:
    """(name, cfg text, where it came from) for a built-in name or a path to a .cfg."""
    if model in BUILTIN:
        text = resources.files("swarm.zoo").joinpath("cfg", f"{model}.cfg").read_text()
        return model, text, f"{model}.cfg"
    path = Path(model)
    if path.suffix == ".cfg" or path.exists():
        if not path.is_file():
            raise SwarmError(f"model file {model} does not exist")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SwarmError(f"cannot read model file {model}: {exc}") from None
        return path.stem, text, str(path)
    raise SwarmError(f"unknown model '{model}'; built-in models are {', '.join(BUILTIN)}, "
                     "or give a path to a darknet .cfg file")


def native_size(sections: list[Section]) -> ImageSize:
    """The [net] section's own width and height (a missing height is the width)."""
    width = sections[0].get_int("width", 416)
    height = sections[0].get_int("height", width)
    if width < 1 or height < 1:
        raise SwarmError(f"{sections[0].where()}: width and height must be at least 1, got {width}x{height}")
    return ImageSize(width, height)


def _scale_anchors(desc: ModelDesc, sections: list[Section], name: str, classes: int | None) -> None:
    """Anchors are written at the [net] size (grid cells for [region], pixels for [yolo]);
    keep their size relative to the image when training at another size. Across a change
    of shape they keep theirs (one factor for both sides), scaled as a photo shaped like the
    new input is: by the larger of the two sides' factors (it fills the new input, and is
    letterboxed into the old one)."""
    if desc.loss not in ("region", "yolo"):
        return
    native = native_size(sections)
    if native == desc.img_size:
        return
    if desc.loss == "yolo":
        factor = max(desc.img_size.width / native.width, desc.img_size.height / native.height)
    else:
        try:
            ref, _ = describe(name, sections, native, classes)
        except SwarmError:
            return
        (gh, gw), (rh, rw) = desc.extra["grid"], ref.extra["grid"]
        factor = max(gh / rh, gw / rw)
    scale_anchors(desc.extra, factor)


def darknet_only_options(model: str, cfg_text: str | None = None) -> list[str]:
    """The options of a .cfg that only steer darknet's own training loop (augmentation,
    schedule, batch bookkeeping), as "section.option": accepted, and not used by swarm."""
    if cfg_text is None:
        _, cfg_text, source = model_source(model)
    else:
        source = model
    return darknet_only(parse_cfg(cfg_text, source))


def describe_model(model: str, img_size: ImageSize | int | None = None, classes: int | None = None,
                   cfg_text: str | None = None) -> ModelDesc:
    """The per-layer description only (no torch): shapes, parameters, FLOPs, bytes."""
    return _prepare(model, img_size, classes, cfg_text)[0]


def _prepare(model: str, img_size: ImageSize | int | None, classes: int | None, cfg_text: str | None):
    if cfg_text is None:
        name, text, source = model_source(model)
    else:
        name, text, source = Path(model).stem if model.endswith(".cfg") else model, cfg_text, model
    sections = parse_cfg(text, source)
    img_size = native_size(sections) if img_size is None else ImageSize.of(img_size)
    if classes is not None and classes < 1:
        raise SwarmError(f"the number of classes must be at least 1, got {classes}")
    check_img_size(name, sections, img_size, classes)
    desc, plans = describe(name, sections, img_size, classes)
    _scale_anchors(desc, sections, name, classes)
    return desc, plans, text


def build_model(model: str, img_size: ImageSize | int | None = None, classes: int | None = None, seed: int | None = None,
                cfg_text: str | None = None, only: range | None = None):
    """Build the torch network. With `seed`, the initial weights depend only on the seed.
    With `only`, just those layers get weights (a stage of a pipeline); the others are
    empty placeholders.

    Returns (net, desc, cfg_text)."""
    import torch

    from swarm.zoo.net import Net

    desc, plans, text = _prepare(model, img_size, classes, cfg_text)
    if seed is not None:
        torch.manual_seed(seed)
    net = Net(desc, make_modules(plans, only), {p.desc.index: p.probability for p in plans if p.desc.kind == "dropout"})
    return net, desc, text


def _side_ok(name: str, sections: list[Section], side: int, classes: int | None, stride: int | None) -> bool:
    """Whether `side` works as a width (and so as a height: the two axes are alike)."""
    try:
        describe(name, sections, ImageSize(side, side), classes)
    except SwarmError:
        return False
    return stride is None or side % stride == 0


def _region_stride(name: str, sections: list[Section], classes: int | None) -> int | None:
    """A detection head's stride at the network's own size (416 / 26 = 16 for yolov2-16; the
    coarsest head's for [yolo] heads, 32 for yolov3-tiny)."""
    try:
        desc, _ = describe(name, sections, native_size(sections), classes)
    except SwarmError:
        return None
    if desc.loss not in ("region", "yolo"):
        return None
    return desc.extra.get("stride")


def check_img_size(name: str, sections: list[Section], img_size: ImageSize, classes: int | None = None) -> None:
    """Raise a SwarmError saying which sizes work when the network cannot take `img_size`.

    A size works when every layer gets a map of at least one pixel, routed maps agree, and
    (for detection) both sides are multiples of the head's stride so grid cells are whole
    pixels. Rows and columns go through the layers alike, so each side is checked alone."""
    stride = _region_stride(name, sections, classes)
    sides = sorted({img_size.width, img_size.height})
    if all(1 <= s <= MAX_IMG_SIZE and _side_ok(name, sections, s, classes, stride) for s in sides):
        return
    valid = [s for s in range(1, MAX_IMG_SIZE + 1) if _side_ok(name, sections, s, classes, stride)]
    if not valid:
        # Report the network's own error at its native size: the .cfg itself is broken.
        describe(name, sections, native_size(sections), classes)
        raise SwarmError(f"{name} cannot take any image size up to {MAX_IMG_SIZE}")
    if img_size.is_square:
        raise SwarmError(f"{name} cannot take --img-size {img_size.width}: it takes {summarise_sizes(valid)}")
    raise SwarmError(f"{name} cannot take --img-size {img_size}: its width and height each take "
                     f"{summarise_sizes(valid)}")


def summarise_sizes(valid: list[int]) -> str:
    """Describe a set of sizes briefly: "multiples of 32 from 64 to 2048" and the like."""
    lo, hi = valid[0], valid[-1]
    step = 0
    for a, b in zip(valid, valid[1:]):
        step = math.gcd(step, b - a)
    if len(valid) == 1:
        return f"only {lo}"
    if valid == list(range(lo, hi + 1, step)):
        upto = f" to {hi}"  # always said: the largest size this swarm takes is a limit too
        if step == 1:
            return f"any size from {lo}{upto}"
        if lo % step == 0:
            return f"multiples of {step} from {lo}{upto}"
        return f"{lo}, {lo + step}, {lo + 2 * step}, ... (steps of {step}){upto}"
    shown = ", ".join(str(v) for v in valid[:8])
    return f"sizes such as {shown}, ..."
