"""Checkpoints: written atomically, read with `torch.load(path, weights_only=True)`.

    {"model": state_dict, "optimizer": optimizer state, "step": int,
     "model_name": str, "img_size": int, "config": {...training flags...}, "cfg": str}
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from swarm.errors import SwarmError

REQUIRED = ("model", "optimizer", "step", "model_name", "img_size")


def atomic_write(path: str | Path, write) -> None:
    """Call write(file) on a temporary file beside `path`, fsync it, then rename it over
    `path`: an interrupted save leaves the previous file untouched."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise SwarmError(f"cannot save to {path}: folder {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
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
    if not path.is_file():
        raise SwarmError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged file
        raise SwarmError(f"{path} is not a readable swarm checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise SwarmError(f"{path} is not a swarm checkpoint (it lacks {', '.join(k for k in REQUIRED if not isinstance(state, dict) or k not in state)})")
    return state
