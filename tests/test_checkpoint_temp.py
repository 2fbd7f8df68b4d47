"""A save killed half-way (SIGKILL in atomic_write) leaves its temporary file beside the
checkpoint; the next save or load of that checkpoint removes it, and nothing else."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import torch

from swarm.local.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import ROOT

STATE = {"model": {"w": torch.ones(2)}, "optimizer": {}, "step": 1, "model_name": "m", "img_size": 8}

KILLED_SAVE = """
import os, sys
from swarm.local.checkpoint import atomic_write

def killed(f):
    f.write(b"x" * 1_000_000)
    f.flush()
    os.kill(os.getpid(), 9)

atomic_write(sys.argv[1], killed)
"""


def killed_save(path) -> list[str]:
    """Run a save of `path` that is SIGKILLed half-way; the temporary files it left."""
    before = set(os.listdir(path.parent))
    r = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(path)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == -9
    left = sorted(set(os.listdir(path.parent)) - before)
    for name in left:  # as if the kill had been a while ago
        old = time.time() - 60
        os.utime(path.parent / name, (old, old))
    return left


def test_a_killed_saves_temporary_file_goes_at_the_next_save_or_load(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, STATE)
    left = killed_save(path)
    assert len(left) == 1 and left[0].startswith(".ckpt.pt.") and left[0].endswith(".tmp"), left
    assert os.path.getsize(tmp_path / left[0]) == 1_000_000

    save_checkpoint(path, {**STATE, "step": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]

    killed_save(path)
    assert load_checkpoint(path)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_only_that_checkpoints_own_stale_files_are_removed(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, STATE)
    others = [".other.pt.abcd1234.tmp",      # another checkpoint's
              ".ckpt.pt.abcd1234.bak",       # not a temporary file
              "ckpt.pt.abcd1234.tmp",        # not hidden: not one of ours
              ".ckpt.pt.x.abcd1234.tmp"]     # a checkpoint named "ckpt.pt.x"
    (tmp_path / "sub").mkdir()
    for name in others + ["sub/.ckpt.pt.abcd1234.tmp"]:  # and ours, but in another folder
        (tmp_path / name).write_bytes(b"keep")
    stale, busy = tmp_path / ".ckpt.pt.stale123.tmp", tmp_path / ".ckpt.pt.busy1234.tmp"
    stale.write_bytes(b"old")
    busy.write_bytes(b"being written")
    for name in others + ["sub/.ckpt.pt.abcd1234.tmp", stale.name, busy.name]:
        old = time.time() - 60
        os.utime(tmp_path / name, (old, old))
    with open(busy, "rb") as held:  # a save under way holds its file locked (a lock of another open file)
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        save_checkpoint(path, {**STATE, "step": 2})
    assert not stale.exists()
    assert busy.exists()
    for name in others + ["sub/.ckpt.pt.abcd1234.tmp"]:
        assert (tmp_path / name).read_bytes() == b"keep", name
    assert load_checkpoint(path)["step"] == 2
