"""`swarm detect`: a trained checkpoint run on photos — boxes drawn on copies, YOLO-format
predictions, JSON; the top classes for a classifier."""
from __future__ import annotations

import argparse
import json
import sys

from swarm.commands.flags import IMG_SIZE_HELP, _number, image_size, positive_int

fraction = _number(float, "a number", lambda v: 0 <= v <= 1, "must be between 0 and 1")


def add_parser(sub) -> None:
    p = sub.add_parser("detect", help="run a trained checkpoint on images",
                       description="Run a checkpoint on image files and folders of them: each image is "
                                   "letterboxed as in training (scaled to fit, its aspect ratio kept, centred on "
                                   "grey) and the boxes mapped back onto it; a detector's boxes (class name, score; a colour per class) are "
                                   "drawn on a copy of it in --out, beside a YOLO-format NAME.txt "
                                   "(class cx cy w h score, relative to the image); a classifier's top classes "
                                   "likewise (class score).")
    p.add_argument("images", nargs="+", metavar="IMAGE|DIR", help="image files, or folders of them")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="a checkpoint written by swarm train")
    p.add_argument("--out", default="detections", metavar="DIR", help="where the drawn copies and .txt files go "
                   "(default: ./detections)")
    p.add_argument("--conf", type=fraction, default=0.25, help="least score of a box kept (default: 0.25)")
    p.add_argument("--nms", type=fraction, default=0.45, help="overlap (IoU) above which the lower-scored of two "
                   "boxes of a class is dropped (default: 0.45)")
    p.add_argument("--top-k", type=positive_int, default=5, help="classes shown for a classifier (default: 5)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="images run at once (default: 8)")
    p.add_argument("--img-size", type=image_size, metavar="N|WxH", help=f"input size: {IMG_SIZE_HELP} (default: the "
                   "size the checkpoint was trained at)")
    p.add_argument("--json", action="store_true", help="print every prediction as JSON on standard output")
    p.add_argument("--threads", type=positive_int, help="compute threads (default: all usable cores, "
                   "fewer where OMP_NUM_THREADS says)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from PIL import Image

    from swarm.errors import SwarmError
    from swarm.local.files import check_checkpoint, find_images

    check_checkpoint(args.checkpoint)  # a mistake is told before torch loads
    paths = find_images(args.images)
    from swarm.local.checkpoint import load_checkpoint
    from swarm.local.detect import Detector, draw, yolo_lines
    from swarm.local.trainer import set_threads

    set_threads(args.threads)
    detector = Detector(load_checkpoint(args.checkpoint), args.conf, args.nms, args.top_k, args.img_size,
                        args.checkpoint)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SwarmError(f"cannot make --out {out}: {exc.strerror or exc}") from None
    tty = sys.stderr.isatty() and len(paths) > 1
    predictions, skipped, stems, done = [], [], set(), 0
    for start in range(0, len(paths), args.batch_size):
        images, names = [], []
        for path in paths[start:start + args.batch_size]:
            try:
                with Image.open(path) as im:
                    im.load()
                    images.append(im.copy())
                names.append(path)
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
                skipped.append(f"{path}: cannot decode the image ({exc.__class__.__name__})")
        for im, p in zip(images, detector.predict(images, names) if images else []):
            stem = p.image.stem
            while stem in stems:  # two inputs of one name (from different folders)
                stem += "_"
            stems.add(stem)
            try:
                draw(im, p).save(out / f"{stem}.jpg", quality=92)
                (out / f"{stem}.txt").write_text(yolo_lines(p))
            except OSError as exc:
                raise SwarmError(f"cannot write to {out}: {exc.strerror or exc}") from None
            predictions.append(p)
        done += len(paths[start:start + args.batch_size])
        if tty:  # a progress bar over a folder
            filled = 24 * done // len(paths)
            print(f"\rdetect [{'#' * filled}{'.' * (24 - filled)}] {done}/{len(paths)} images", end="",
                  file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    if args.json:
        print(json.dumps([p.as_dict() for p in predictions], indent=1))
    else:
        for p in predictions:
            found = (", ".join(f"{t['name']} {t['score']:.2f}" for t in p.top[:3]) if p.top else
                     ", ".join(f"{b['name']} {b['score']:.2f}" for b in p.boxes[:6])
                     + (f" and {len(p.boxes) - 6} more" if len(p.boxes) > 6 else "") or "nothing")
            print(f"{p.image}: {found}")
    what = "boxes" if detector.is_detector else f"top-{args.top_k} classes"
    print(f"{len(predictions)} image(s), {what} drawn in {out}/ with YOLO-format .txt beside them"
          + (f"; {len(skipped)} skipped" if skipped else ""), file=sys.stderr)
    if not predictions:
        raise SwarmError("no image could be decoded")
    return 0
