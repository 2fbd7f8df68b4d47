"""Checkpoints: written atomically, read with `torch.load(path, weights_only=True)`.

    {"model": state_dict, "optimizer": optimizer state, "step": int,
     "model_name": str, "img_size": int, "config": {...training flags...}, "cfg": str}
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import torch

from swarm.errors import SwarmError

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
    if not path.is_file():
        raise SwarmError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged file
        raise SwarmError(f"{path} is not a readable swarm checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise SwarmError(f"{path} is not a swarm checkpoint (it lacks {', '.join(k for k in REQUIRED if not isinstance(state, dict) or k not in state)})")
    return state
