"""A network's loss heads as darknet writes them: [region] (YOLOv2), [yolo] (YOLOv3 and later,
one per scale), [detection] (YOLOv1), [softmax]/[cost] (classifiers); and the options that
only steer darknet's own training loop, which swarm accepts and leaves to its own flags.

A head's parameters go into the model description's `extra` dict, which the losses in
`swarm/zoo/loss.py` read. Anchors are kept relative to the image: written in grid cells
([region]) or pixels of the [net] size ([yolo]), they are rescaled when training at another
size by the larger of the two sides' factors (as a photo shaped like the new input is).
"""
from __future__ import annotations

import math

from swarm.errors import SwarmError
from swarm.zoo.darknet import Section

HEAD_SECTIONS = ("region", "detection", "softmax", "cost")  # the last sections of a network
IOU_LOSSES = ("mse", "iou", "giou", "diou", "ciou")

# Options of darknet's own training loop — augmentation, the learning-rate schedule, batch
# bookkeeping, inference-time NMS — that swarm's own flags and data pipeline stand for. They
# are accepted wherever darknet takes them and listed once when a run starts.
DARKNET_OWN = {
    "net": {"batch", "subdivisions", "width", "height", "channels", "momentum", "decay", "learning_rate",
            "burn_in", "max_batches", "policy", "steps", "scales", "step", "scale", "power", "gamma", "max_epochs",
            "angle", "saturation", "exposure", "hue", "aspect", "jitter", "flip", "mosaic", "mosaic_bound",
            "cutmix", "mixup", "blur", "gaussian_noise", "letter_box", "min_crop", "max_crop", "label_smooth_eps",
            "ema_alpha", "adam", "B1", "b1", "b2", "eps", "track", "time_steps", "augment_speed",
            "sequential_subdivisions", "try_fix_nan", "loss_scale", "dynamic_minibatch", "max_chart_loss",
            "optimized_memory", "workspace_size_limit_MB", "inputs", "random", "resize", "contrastive",
            "unsupervised", "equidistant_point", "num_sigmas_reject_badlabels", "badlabels_rejection_percentage",
            "show_receptive_field", "rotate", "center"},
    "yolo": {"jitter", "random", "resize", "nms_kind", "beta_nms", "counters_per_class", "focal_loss",
             "track_history_size", "sim_thresh", "dets_for_track", "dets_for_show", "track_ciou_norm",
             "embedding_layer", "map", "uc_normalizer", "show_details", "iou_thresh_kind", "yolo_point"},
    "region": {"jitter", "random", "bias_match", "absolute", "tree", "map", "focal_loss", "log", "sqrt"},
    "detection": {"jitter", "random", "forced", "reorg"},
    "crop": {"angle", "saturation", "exposure", "shift"},
    "softmax": {"groups", "temperature", "tree", "noloss", "spatial"},
    "cost": {"type", "scale", "ratio", "noobject_scale", "thresh"},
}


# What swarm's data pipeline reads of them (swarm.data.augment).
AUGMENTATION = {"net": {"jitter", "hue", "saturation", "exposure", "flip", "angle", "mosaic"},
                "yolo": {"jitter"}, "region": {"jitter"}, "detection": {"jitter"}}


def darknet_only(sections: list[Section]) -> list[str]:
    """The darknet-only options a .cfg sets, as "section.option" once each (for the log); the
    [net] size and channels and the augmentation options, which swarm reads, are not among them."""
    seen = []
    for sec in sections:
        for key in sec.options:
            if sec.name == "net" and key in ("width", "height", "channels") or key in AUGMENTATION.get(sec.name, ()):
                continue
            if key in DARKNET_OWN.get(sec.name, ()) and f"{sec.name}.{key}" not in seen:
                seen.append(f"{sec.name}.{key}")
    return seen


def accept_darknet_own(sec: Section) -> None:
    """Mark the section's darknet-only options as understood."""
    sec.used.update(k for k in sec.options if k in DARKNET_OWN.get(sec.name, ()))


def refuse_unknown(sec: Section) -> None:
    accept_darknet_own(sec)
    unused = set(sec.options) - sec.used
    if unused:
        raise SwarmError(f"{sec.where()}: option(s) {', '.join(sorted(unused))} not understood")


def _anchors(sec: Section, num: int) -> list[tuple[float, float]]:
    values = sec.get_floats("anchors")
    if len(values) != 2 * num:
        raise SwarmError(f"{sec.where()}: {len(values)} anchor values given, need 2 x num = {2 * num}")
    return [(values[2 * i], values[2 * i + 1]) for i in range(num)]


def region_head(sec: Section, classes_override: int | None) -> dict:
    num = sec.get_int("num", 5)
    classes = sec.get_int("classes", 20)
    if classes_override is not None:
        classes = classes_override
    if sec.get_int("coords", 4) != 4:
        raise SwarmError(f"{sec.where()}: only coords=4 is supported")
    if sec.get_int("softmax", 1) != 1:  # darknet's YOLOv2 cfgs say softmax=1; swarm's head always applies it
        raise SwarmError(f"{sec.where()}: softmax={sec.options['softmax']}: swarm's [region] head takes a softmax over "
                         "the class scores (softmax=1, as darknet's YOLOv2 cfgs say)")
    head = {
        "loss": "region", "classes": classes, "num": num, "anchors": _anchors(sec, num),
        "object_scale": sec.get_float("object_scale", 5.0), "noobject_scale": sec.get_float("noobject_scale", 1.0),
        "class_scale": sec.get_float("class_scale", 1.0), "coord_scale": sec.get_float("coord_scale", 1.0),
        "thresh": sec.get_float("thresh", 0.6), "rescore": bool(sec.get_int("rescore", 0)),
    }
    refuse_unknown(sec)
    return head


def detection_head(sec: Section, classes_override: int | None) -> dict:
    """YOLOv1: a [connected] output of side x side cells, each `num` boxes and the classes."""
    classes = sec.get_int("classes", 20)
    if classes_override is not None:
        classes = classes_override
    head = {
        "loss": "detection", "classes": classes, "side": sec.get_int("side", 7), "num": sec.get_int("num", 1),
        "coords": sec.get_int("coords", 1), "sqrt": bool(sec.get_int("sqrt", 0)),
        "rescore": bool(sec.get_int("rescore", 0)), "softmax": bool(sec.get_int("softmax", 0)),
        "object_scale": sec.get_float("object_scale", 1.0), "noobject_scale": sec.get_float("noobject_scale", 1.0),
        "class_scale": sec.get_float("class_scale", 1.0), "coord_scale": sec.get_float("coord_scale", 1.0),
    }
    if head["coords"] != 4:
        raise SwarmError(f"{sec.where()}: only coords=4 is supported")
    if head["side"] < 1 or head["num"] < 1:
        raise SwarmError(f"{sec.where()}: side and num must be at least 1")
    refuse_unknown(sec)
    return head


def detection_outputs(head: dict) -> int:
    return head["side"] ** 2 * (head["classes"] + head["num"] * (head["coords"] + 1))


def yolo_head(sec: Section, layer: int, classes_override: int | None) -> dict:
    """One [yolo] layer's loss parameters (darknet's defaults); anchors in pixels of the [net] size."""
    num = sec.get_int("num", 1)
    classes = sec.get_int("classes", 20)
    if classes_override is not None:
        classes = classes_override
    anchors = _anchors(sec, num) if "anchors" in sec.options else None
    if anchors is None:
        raise SwarmError(f"{sec.where()}: missing 'anchors='")
    mask = sec.get_ints("mask") if "mask" in sec.options else list(range(num))
    for m in mask:
        if not 0 <= m < num:
            raise SwarmError(f"{sec.where()}: mask index {m} is beyond num={num} anchors")
    iou_loss = sec.get_str("iou_loss", "mse").lower()
    if iou_loss not in IOU_LOSSES:
        raise SwarmError(f"{sec.where()}: iou_loss={iou_loss} is not one of {', '.join(IOU_LOSSES)}")
    head = {
        "layer": layer, "classes": classes, "anchors": anchors, "mask": mask,
        "ignore_thresh": sec.get_float("ignore_thresh", 0.5), "truth_thresh": sec.get_float("truth_thresh", 1.0),
        "iou_thresh": sec.get_float("iou_thresh", 1.0), "scale_x_y": sec.get_float("scale_x_y", 1.0),
        "iou_loss": iou_loss, "iou_normalizer": sec.get_float("iou_normalizer", 0.75),
        "cls_normalizer": sec.get_float("cls_normalizer", 1.0), "obj_normalizer": sec.get_float("obj_normalizer", 1.0),
        "max_delta": sec.get_float("max_delta", math.inf), "new_coords": bool(sec.get_int("new_coords", 0)),
        "label_smooth_eps": sec.get_float("label_smooth_eps", 0.0),
        "objectness_smooth": bool(sec.get_int("objectness_smooth", 0)),
    }
    refuse_unknown(sec)
    return head


def scale_anchors(extra: dict, factor: float) -> None:
    """Anchors of every head multiplied by `factor` (training at another size than [net]'s)."""
    if extra["loss"] == "region":
        extra["anchors"] = [(w * factor, h * factor) for w, h in extra["anchors"]]
    elif extra["loss"] == "yolo":
        for head in extra["heads"]:
            head["anchors"] = [(w * factor, h * factor) for w, h in head["anchors"]]
