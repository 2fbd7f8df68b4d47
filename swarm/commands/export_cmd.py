"""`swarm export`: a checkpoint's network as ONNX, TorchScript or darknet .cfg/.weights, checked against torch."""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
import warnings
from pathlib import Path

from swarm.commands.flags import IMG_SIZE_HELP, image_size, positive_int
from swarm.errors import SwarmError

FORMATS = ("onnx", "torchscript", "darknet")
CHECK_BATCH = 2  # images in the input the exported model is checked on
TOLERANCE = 1e-4  # relative to the largest output value


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's network as ONNX, TorchScript or darknet files",
                       description=(
                           "Write a trained network for other programs. ONNX and TorchScript take a float32 batch "
                           "(B, C, H, W) of RGB images in [0, 1] at the trained size (or --img-size) and give the "
                           "last layer's raw "
                           "output; both are run on a test batch and compared with torch (ONNX when onnxruntime is "
                           "installed). darknet writes OUT.cfg and OUT.weights in darknet's own layout."))
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="a checkpoint written by swarm train")
    p.add_argument("--format", required=True, choices=FORMATS, help="onnx, torchscript, or darknet (.cfg + .weights)")
    p.add_argument("--out", required=True, metavar="PATH", help="the file to write (darknet: PATH.cfg and "
                   "PATH.weights)")
    p.add_argument("--img-size", type=image_size, metavar="N|WxH", help=f"input size: {IMG_SIZE_HELP} (default: the "
                   "size the checkpoint was trained at)")
    p.add_argument("--threads", type=positive_int, help="compute threads (default: all usable cores, "
                   "fewer where OMP_NUM_THREADS says)")
    p.set_defaults(run=run)


def checkpoint_network(state: dict, path: str, img_size=None):
    """The checkpoint's network in float32, in inference mode, and its description."""
    import torch

    from swarm.local.checkpoint import load_network

    net, desc, text = load_network(state, path, img_size)
    return net.to(torch.float32).eval(), desc, text


def check_input(desc):
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.rand(CHECK_BATCH, desc.in_channels, *desc.img_size.hw, generator=gen)


def output_names(desc) -> list[str]:
    """"output" for a network with one output; "output0", "output1", ... (in head order) for several."""
    return ["output"] if len(desc.outputs) == 1 else [f"output{i}" for i in range(len(desc.outputs))]


def compare(expected, got) -> tuple[float, bool]:
    """(max abs difference, within TOLERANCE of the largest output), over every output."""
    import torch

    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    if len(got) != len(expected):
        return float("inf"), False
    worst, ok = 0.0, True
    for e, g in zip(expected, got):
        g = torch.as_tensor(g)
        if tuple(g.shape) != tuple(e.shape):
            return float("inf"), False
        diff = float((g - e).abs().max())
        worst, ok = max(worst, diff), ok and diff <= TOLERANCE * max(1.0, float(e.abs().max()))
    return worst, ok


def export_onnx(net, desc, out: Path) -> str:
    """Write `out` with torch's exporter (torch.export-based; needs onnx and onnxscript);
    the batch dimension stays free. Checked in onnxruntime when it is installed."""
    import torch

    if "dynamo" not in inspect.signature(torch.onnx.export).parameters:
        raise SwarmError(f"ONNX export needs torch 2.5 or newer (this is {torch.__version__})")
    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise SwarmError(f"ONNX export needs {' and '.join(missing)}: pip install onnx onnxscript onnxruntime "
                         "(or swarm-train[export])")
    x = check_input(desc)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the exporter logs that optional torchvision ops are skipped
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(net, (x,), dynamo=True, verbose=False, input_names=["images"],
                                        output_names=output_names(desc),
                                        dynamic_shapes=({0: torch.export.Dim("batch")},))
            program.save(str(out), external_data=False)
    except Exception as exc:
        raise SwarmError(f"ONNX export of {desc.name} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    finally:
        quiet.setLevel(level)
    if importlib.util.find_spec("onnxruntime") is None:
        return "not checked: onnxruntime is not installed (pip install onnxruntime)"
    import onnxruntime

    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {"images": x.numpy()})
    return _verdict("onnxruntime", net, x, got if len(got) > 1 else got[0])


def export_torchscript(net, desc, out: Path) -> str:
    """Trace the network into `out` and run the saved file on the check batch."""
    import torch

    x = check_input(desc)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(net, (x,))
        torch.jit.save(traced, str(out))
        got = torch.jit.load(str(out))(x)
    return _verdict("the saved TorchScript", net, x, got)


def _verdict(runner: str, net, x, got) -> str:
    import torch

    with torch.no_grad():
        expected = net(x)
    diff, ok = compare(expected, got)
    text = f"{runner} against torch: max abs difference {diff:.2g} on {len(x)} images"
    if not ok:
        largest = max(float(e.abs().max()) for e in (expected if isinstance(expected, list) else [expected]))
        raise ExportMismatch(f"{text}, more than {TOLERANCE:g} of the largest output {largest:.3g}")
    return text


class ExportMismatch(Exception):
    """The exported model computes something else than the torch network."""


def darknet_unwritten(desc) -> str | None:
    """What of the network --format darknet does not write yet, in words (None: all of it)."""
    if desc.loss == "detection":
        return "a [detection] head"
    return None


def export_darknet(net, desc, cfg_text: str, source: str, out: Path, seen: int) -> tuple[list[Path], str, list[str]]:
    """Write OUT.cfg and OUT.weights; read the weights back to check every tensor, and build the
    written pair with swarm's own reader to check that it computes the network's outputs."""
    import io
    import os

    import numpy as np

    from swarm.local.checkpoint import atomic_write
    from swarm.zoo.darknet_weights import darknet_cfg, read_weights, write_weights

    base = out.with_suffix("") if out.suffix in (".cfg", ".weights") else out
    cfg_path, weights_path = Path(f"{base}.cfg"), Path(f"{base}.weights")
    text, notes = darknet_cfg(cfg_text, desc, source)
    state = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    buffer = io.BytesIO()
    count = write_weights(buffer, state, desc, seen)
    data = buffer.getvalue()
    umask = os.umask(0)
    os.umask(umask)
    for path, content in ((cfg_path, text.encode()), (weights_path, data)):
        atomic_write(path, lambda f, content=content: f.write(content))
        os.chmod(path, 0o666 & ~umask)  # readable like any file written here, not private like a checkpoint
    back = read_weights(weights_path.read_bytes(), {k: v.shape for k, v in state.items()}, desc, str(weights_path))
    if back.layers != [d.index for d in desc.layers if d.kind in ("conv", "connected")] or \
            not all(np.array_equal(v, state[k]) for k, v in back.tensors.items()):
        raise ExportMismatch(f"{weights_path} does not read back as the weights written")
    outputs = _darknet_read_back(net, desc, cfg_path, text, weights_path, data)
    check = f"{count} values in {len(back.layers)} layers, read back identical; {outputs}"
    return [cfg_path, weights_path], check, notes


def _darknet_read_back(net, desc, cfg_path: Path, text: str, weights_path: Path, data: bytes) -> str:
    """The written .cfg built by swarm's reader (with any layers the writer added), the written
    .weights loaded into it, run on the check batch against the network."""
    import torch

    from swarm.zoo import build_model
    from swarm.zoo.darknet_weights import read_weights

    try:
        back, back_desc, _ = build_model(str(cfg_path), desc.img_size, cfg_text=text)
        state = back.state_dict()
        weights = read_weights(data, {k: tuple(v.shape) for k, v in state.items()}, back_desc, str(weights_path))
    except SwarmError as exc:
        raise ExportMismatch(f"swarm does not read it back: {exc}") from None
    if len(weights.layers) != weights.of_layers:
        raise ExportMismatch(f"{weights_path} covers {len(weights.layers)} of the {weights.of_layers} layers with "
                             f"weights in {cfg_path}")
    state.update({k: torch.from_numpy(v) for k, v in weights.tensors.items()})
    back.load_state_dict(state)
    x = check_input(desc)
    with torch.no_grad():
        got = back.to(torch.float32).eval()(x)
    return _verdict("swarm's reader on the written .cfg and .weights", net, x, got)


def run(args: argparse.Namespace) -> int:
    import sys

    from swarm.local.files import check_checkpoint

    check_checkpoint(args.checkpoint)  # a mistake is told before torch loads
    from swarm.local.checkpoint import load_checkpoint
    from swarm.local.trainer import set_threads
    from swarm.zoo import model_source

    set_threads(args.threads)
    state = load_checkpoint(args.checkpoint)
    net, desc, cfg_text = checkpoint_network(state, args.checkpoint, args.img_size)
    broken = [k for k, v in net.state_dict().items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if broken:
        raise SwarmError(f"{args.checkpoint} holds weights that are not finite ({broken[0]}, and {len(broken) - 1} "
                         "more tensors): its training diverged; export an earlier checkpoint, or train again with a "
                         "smaller --lr")
    out = Path(args.out)
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise SwarmError(f"cannot write {out}: folder {folder} does not exist")
    what = f"{desc.name} at step {state['step']}"
    try:
        if args.format == "darknet":
            unwritten = darknet_unwritten(desc)
            if unwritten:
                raise SwarmError(f"--format darknet writes networks with [yolo], [region] or [softmax] heads; "
                                 f"{desc.name} has {unwritten}: export it as onnx or torchscript")
            if cfg_text is None:
                _, cfg_text, _ = model_source(state["model_name"])
            seen = int(state["step"]) * int(state.get("config", {}).get("batch_size", 0))
            source = f"{Path(state['model_name']).stem}.cfg"
            paths, check, notes = export_darknet(net, desc, cfg_text, source, out, seen)
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            print(f"wrote {' and '.join(map(str, paths))}: {what}; {check}")
            return 0
        check = (export_onnx if args.format == "onnx" else export_torchscript)(net, desc, out)
    except ExportMismatch as exc:
        print(f"swarm export: {out} was written but {exc}", file=sys.stderr)
        return 1
    import torch

    with torch.no_grad():
        got = net(check_input(desc)[:1])
    shapes = [tuple(t.shape[1:]) for t in (got if isinstance(got, list) else [got])]
    c, (h, w) = desc.in_channels, desc.img_size.hw
    colour = "RGB " if c == 3 else ""
    outputs = ", ".join(f"'{name}' (batch, {', '.join(map(str, shape))})" for name, shape in zip(output_names(desc), shapes))
    print(f"wrote {out}: {what}; input 'images' float32 (batch, {c}, {h}, {w}) {colour}in [0, 1], "
          f"output{'s' if len(shapes) > 1 else ''} {outputs}; {check}")
    return 0
