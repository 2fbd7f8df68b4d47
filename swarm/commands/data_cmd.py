"""`swarm data sample DIR`: a small data set in the YOLO folder format (or, with --task classify,
one folder of images per class), to look at and train on."""
from __future__ import annotations

import argparse

from swarm.commands.flags import IMG_SIZE_HELP, _number, image_size, model_name

SAMPLE_SIZES = _number(int, "a whole number", lambda v: 32 <= v <= 2048, "must be between 32 and 2048")
SAMPLE_COUNT = _number(int, "a whole number", lambda v: 10 <= v <= 100000, "must be between 10 and 100000")


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="data set tools", description="Tools for data sets in the YOLO folder format.")
    tools = p.add_subparsers(dest="tool", metavar="TOOL", required=True)
    s = tools.add_parser("sample", help="write a small YOLO-format data set",
                         description="Write a small data set in the YOLO folder format: DIR/train/images/*.jpg with "
                                     "DIR/train/labels/*.txt (one 'class cx cy w h' line per object, relative to the "
                                     "image), the same under DIR/val/, and DIR/classes.txt. The pictures are the "
                                     "built-in shapes at --width x --height, so `swarm train --data DIR` works on "
                                     "it at once, and it shows what your own folder should look like.")
    s.add_argument("dir", metavar="DIR", help="the folder to write (must not exist, or be empty)")
    s.add_argument("--task", choices=("detect", "classify"), default="detect",
                   help="detect (default): the YOLO layout above; classify: DIR/train/CLASS/*.jpg and "
                        "DIR/val/CLASS/*.jpg, each picture in the folder of its largest shape, for a classifier")
    s.add_argument("--count", type=SAMPLE_COUNT, default=200, help="images in all (default: 200)")
    s.add_argument("--val", type=float, default=0.1, help="share of them held out in val/ (default: 0.1)")
    s.add_argument("--width", type=SAMPLE_SIZES, default=320, help="image width in pixels (default: 320)")
    s.add_argument("--height", type=SAMPLE_SIZES, default=240, help="image height in pixels (default: 240)")
    a = tools.add_parser("anchors", help="fit a model's [yolo] anchors to a data set's boxes",
                         description="Fit the anchors of a model's [yolo] heads to the boxes of a YOLO-format data "
                                     "set's training pictures, as darknet's `detector calc_anchors` does (k-means "
                                     "with 1 - IoU as the distance), at the size the model trains at, and print "
                                     "darknet's anchors= line. `swarm train --anchors auto` fits the same ones when "
                                     "a run starts.")
    a.add_argument("dir", metavar="DIR", help="the data set (images/ and labels/, as `swarm data sample` writes)")
    a.add_argument("--model", type=model_name, required=True,
                   help="a built-in model with [yolo] heads (yolov3-tiny, yolov4-tiny, "
                   "yolov7-tiny) or a .cfg path")
    a.add_argument("--img-size", type=image_size, metavar="N|WxH", help=f"input size in pixels: {IMG_SIZE_HELP} "
                   "(default: the size `swarm train` takes for the model)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.tool == "anchors":
        return run_anchors(args)
    return run_sample(args)


def run_anchors(args: argparse.Namespace) -> int:
    from swarm.data import open_datasets
    from swarm.zoo import default_img_size, describe_model
    from swarm.zoo.anchors import anchors_line, box_sizes, fitted_anchors, yolo_anchor_slots

    desc = describe_model(args.model, default_img_size(args.model, args.img_size))
    yolo_anchor_slots(desc)  # a model without [yolo] heads: say so before reading the data
    train, _ = open_datasets(args.dir, desc.img_size, desc.in_channels)
    wh = box_sizes(train)
    if not len(wh):
        from swarm.errors import SwarmError

        raise SwarmError(f"{train.name} has no boxes: its label files are empty")
    anchors, before, after = fitted_anchors(desc, wh)
    _, used = yolo_anchor_slots(desc)
    print(f"{desc.name} at {desc.img_size}: anchors fitted to the {len(wh)} boxes of {train.name}, in pixels of "
          f"that input (a .cfg whose [net] width and height say {desc.img_size.width} and "
          f"{desc.img_size.height} takes them as they are)")
    print(f"anchors={anchors_line(anchors)}")
    unused = [i for i in range(len(anchors)) if i not in used]
    if unused:
        print(f"anchor(s) {', '.join(map(str, unused))} in no head's mask: kept as the .cfg has them")
    print(f"mean IoU of a box with its anchor: {before:.3f} with the .cfg's anchors, {after:.3f} fitted")
    return 0


def run_sample(args: argparse.Namespace) -> int:
    from pathlib import Path

    from PIL import Image

    from planner.image_size import ImageSize
    from swarm.data.shapes import CLASSES, SyntheticShapes
    from swarm.errors import SwarmError

    if not 0 < args.val < 1:
        raise SwarmError(f"--val is the share held out, between 0 and 1 (exclusive); got {args.val}")
    root = Path(args.dir)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise SwarmError(f"{root} already exists and is not an empty folder; name a new one")
    held = max(1, round(args.count * args.val))
    size = ImageSize(args.width, args.height)
    shapes = {"train": SyntheticShapes("train", size, 3, size=args.count - held),
              "val": SyntheticShapes("heldout", size, 3, size=held)}
    try:
        if args.task == "classify":
            return _write_classes(root, shapes, args)
        for split, data in shapes.items():
            (root / split / "images").mkdir(parents=True, exist_ok=True)
            (root / split / "labels").mkdir(parents=True, exist_ok=True)
            for k in range(len(data)):
                arr, boxes = data.load(k)  # (3, H, W); boxes relative to the image
                im = Image.fromarray(arr.transpose(1, 2, 0))
                name = f"{split}{k:05d}"
                im.save(root / split / "images" / f"{name}.jpg", quality=90)
                (root / split / "labels" / f"{name}.txt").write_text(
                    "".join(f"{int(c)} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}\n" for c, cx, cy, w, h in boxes))
        (root / "classes.txt").write_text("".join(f"{name}\n" for name in CLASSES))
    except OSError as exc:
        raise SwarmError(f"cannot write {root}: {exc.strerror or exc}") from None
    print(f"wrote {args.count - held} training and {held} held-out images ({args.width}x{args.height}, "
          f"{len(CLASSES)} classes) to {root}; train on it with: swarm train --data {root}")
    return 0


def _write_classes(root, shapes: dict, args: argparse.Namespace) -> int:
    """Each picture under SPLIT/CLASS/, CLASS the name of its largest shape's class."""
    from PIL import Image

    from swarm.data import class_targets
    from swarm.data.shapes import CLASSES

    counts = {}
    for split, data in shapes.items():
        for k in range(len(data)):
            arr, boxes = data.load(k)
            name = CLASSES[int(class_targets(boxes[None])[0])]
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(arr.transpose(1, 2, 0)).save(folder / f"{split}{k:05d}.jpg", quality=90)
            counts[split] = counts.get(split, 0) + 1
    print(f"wrote {counts['train']} training and {counts['val']} held-out images ({args.width}x{args.height}) in "
          f"one folder per class ({', '.join(CLASSES)}) to {root}; train a classifier on it with: "
          f"swarm train --model resnet18 --data {root}")
    return 0
