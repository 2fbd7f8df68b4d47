"""Checkpoints: written atomically, read with `torch.load(path, weights_only=True)`.

    {"model": state_dict, "optimizer": optimizer state, "step": int,
     "model_name": str, "img_size": int or "WxH", "config": {...training flags...}, "cfg": str}

`load_checkpoint` gives "img_size" (and the config's) as an ImageSize.
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import torch

from planner.image_size import ImageSize
from swarm.errors import SwarmError
from swarm.local.files import TORCH_HEADS, check_checkpoint, check_weights, describe_file

try:
    import fcntl
except ImportError:  # not POSIX: stale files are told by their age alone
    fcntl = None

REQUIRED = ("model", "optimizer", "step", "model_name", "img_size")


# A save's temporary file: ".NAME.XXXXXXXX.tmp" beside NAME (tempfile.mkstemp's 8 characters).
# The saving process holds an exclusive lock on it until it is renamed; one nobody holds, not
# written to for FRESH_S, was left by a save that was killed.
TEMP_CHARACTERS = "[a-z0-9_]{8}"
FRESH_S = 2.0


def temp_pattern(path: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(path.name)}\.{TEMP_CHARACTERS}\.tmp")


def remove_stale_temp_files(path: str | Path) -> list[Path]:
    """Remove the temporary files that interrupted saves of `path` left in its folder (only
    that checkpoint's own, only those no save under way holds); the paths removed."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    pattern = temp_pattern(path)
    removed = []
    try:
        candidates = [entry for entry in directory.iterdir() if pattern.fullmatch(entry.name)]
    except OSError:
        return removed
    for entry in candidates:
        try:
            fd = os.open(entry, os.O_RDONLY)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < FRESH_S or not _try_lock(fd):
                continue  # a save under way
            os.unlink(entry)
            removed.append(entry)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _try_lock(fd: int) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def atomic_write(path: str | Path, write) -> None:
    """Call write(file) on a temporary file beside `path`, fsync it, then rename it over
    `path`: an interrupted save leaves the previous file untouched, and what a killed one
    left is removed by the next save (or load) of the same path."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise SwarmError(f"cannot save to {path}: folder {directory} does not exist")
    remove_stale_temp_files(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            _try_lock(f.fileno())  # held until closed, after the rename: no sweep takes it from us
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def save_checkpoint(path: str | Path, state: dict) -> None:
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise ValueError(f"checkpoint lacks {missing}")
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except OSError as exc:
        raise SwarmError(f"cannot save checkpoint to {path}: {exc.strerror or exc}") from None


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    remove_stale_temp_files(path)
    check_checkpoint(path)
    state = _torch_load(path, f"{path} is not a swarm checkpoint")
    if not isinstance(state, dict):
        raise SwarmError(f"{path} is not a swarm checkpoint: it is a torch file holding a {type(state).__name__}, "
                         "not a dictionary")
    if "model" not in state:
        raise SwarmError(f"{path} is not a swarm checkpoint: it is {_describe_dict(state)} without 'model'")
    if not isinstance(state["model"], dict) or not all(torch.is_tensor(v) for v in state["model"].values()):
        raise SwarmError(f"{path} is not a swarm checkpoint: its 'model' is a {type(state['model']).__name__}, "
                         "not a state dict of tensors")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise SwarmError(f"{path} is not a swarm checkpoint: it is {_describe_dict(state)} that lacks "
                         f"{', '.join(missing)}")
    try:
        state["img_size"] = ImageSize.of(state["img_size"])
        config = state.get("config")
        if isinstance(config, dict) and config.get("img_size") is not None:
            config["img_size"] = ImageSize.of(config["img_size"])
    except (ValueError, TypeError) as exc:
        raise SwarmError(f"{path} is not a swarm checkpoint: its image size is not one ({exc})") from None
    return state


def load_network(state: dict, where: str, img_size: ImageSize | None = None):
    """(net, desc, cfg text): the checkpoint's network with its weights, at the size it was
    trained at or at `img_size` (any size its layers take, unless it has [connected] layers,
    whose weights are made for one size). `where` names the checkpoint in errors."""
    from swarm.zoo import build_model

    trained = state["img_size"]
    size = trained if img_size is None else img_size
    net, desc, text = build_model(state["model_name"], size, state.get("config", {}).get("classes"),
                                  cfg_text=state.get("cfg"))
    try:
        net.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        at = "" if size == trained else f" at --img-size {size.to_json()} (it was trained at {trained.to_json()})"
        raise SwarmError(f"{where}: the weights do not fit {state['model_name']}{at} ({first})") from None
    return net, desc, text


def _torch_load(path: Path, not_what: str):
    """torch.load(path, weights_only=True), or a SwarmError "`not_what`: what the file is instead"."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a file it cannot read
        raise SwarmError(f"{not_what}: {describe_file(path, exc)}") from None


def _describe_dict(state: dict) -> str:
    keys = list(state)
    if keys and all(torch.is_tensor(v) for v in state.values()):
        return f"a torch state dict ({len(keys)} tensor{'s' if len(keys) > 1 else ''}, such as '{keys[0]}')"
    shown = ", ".join(repr(k) for k in keys[:5]) + (", ..." if len(keys) > 5 else "")
    return f"a torch dictionary with keys {shown}" if keys else "an empty torch dictionary"


def load_initial_weights(net, path: str | Path) -> str:
    """Load the weights a training run starts from into `net` (a zoo network): darknet
    .weights (a whole model, or a backbone's first layers) or a swarm checkpoint's model.
    Layers the file does not cover keep their initial weights. Returns what was loaded, in
    words; a file that does not fit is a SwarmError naming the layer and both shapes."""
    from swarm.zoo.darknet_weights import read_weights

    path = Path(path)
    check_weights(path)
    with open(path, "rb") as f:
        head = f.read(16)
    own = net.state_dict()
    if head.startswith(TORCH_HEADS):
        state = load_checkpoint(path)
        tensors = state["model"]
        odd = [k for k in tensors if not re.fullmatch(r"layers\.\d+\..+", k)]
        if odd:
            raise SwarmError(f"{path} does not hold a swarm network: its 'model' has keys such as '{odd[0]}' "
                             "where a swarm network's are layers.N.*")
        for layer in sorted({_layer_of(k) for k in tensors}):
            theirs = {k: tuple(v.shape) for k, v in tensors.items() if _layer_of(k) == layer}
            mine = {k: tuple(v.shape) for k, v in own.items() if _layer_of(k) == layer}
            if theirs != mine:
                raise SwarmError(f"{path} does not fit {net.desc.name} at layer {layer}: "
                                 f"{_differences(theirs, mine)} (the file was saved from {state['model_name']})")
        layers = sorted({_layer_of(k) for k in tensors})
        seen = f"step {state['step']} of {state['model_name']}"
    else:  # darknet's (check_weights refused anything else)
        darknet = read_weights(path.read_bytes(), {k: tuple(v.shape) for k, v in own.items()}, net.desc, str(path))
        tensors = {k: torch.from_numpy(v) for k, v in darknet.tensors.items()}
        layers = darknet.layers
        seen = f"darknet {'.'.join(map(str, darknet.version))}, {darknet.seen} images seen"
    with torch.no_grad():
        for key, value in tensors.items():
            own[key].copy_(value)
    total = len({_layer_of(k) for k in own})
    covered = "" if not layers else f" (layer {layers[0]})" if len(layers) == 1 else f" (layers {layers[0]}-{layers[-1]})"
    return f"started from {path} ({seen}): {len(layers)} of {total} layers with weights loaded{covered}"


def _differences(theirs: dict, mine: dict) -> str:
    """How one layer's tensor shapes in a file differ from the model's, in words."""
    def listed(shapes: dict) -> str:
        return ", ".join(f"{k.split('.', 2)[2]} {_shape(v)}" for k, v in shapes.items()
                         if not k.endswith("num_batches_tracked")) or "no weights"

    if theirs.keys() == mine.keys():
        return "; ".join(f"{k.split('.', 2)[2]} is {_shape(theirs[k])} in the file and {_shape(mine[k])} in the model"
                         for k in theirs if theirs[k] != mine[k])
    return f"the file has {listed(theirs)}; the model has {listed(mine)}"


def _layer_of(key: str) -> int:
    return int(key.split(".")[1])


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "a scalar"
