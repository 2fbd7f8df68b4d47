"""The command line as a user meets it: the main job, identical reruns, resume, and mistakes."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_swarm

QUICK = ["--model", "yolov2-16", "--img-size", "64", "--batch-size", "4", "--seed", "1", "--threads", "1"]


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


def test_train_twice_identical_and_resume(tmp_path):
    a = run_swarm("train", *QUICK, "--steps", "3", "--save", "a.pt", "--no-eval", cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    assert "checkpoint: " in a.stdout and str(tmp_path / "a.pt") in a.stdout
    b = run_swarm("train", *QUICK, "--steps", "3", "--save", "b.pt", "--no-eval", cwd=tmp_path)
    assert b.returncode == 0, b.stderr
    wa, wb = _weights(tmp_path / "a.pt"), _weights(tmp_path / "b.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # resume: 3 steps then 2 more equals 5 straight; the flags come from the checkpoint
    full = run_swarm("train", *QUICK, "--steps", "5", "--save", "full.pt", "--no-eval", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    res = run_swarm("train", "--resume", "a.pt", "--steps", "5", "--save", "r.pt", "--no-eval", "--threads", "1",
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    wf, wr = _weights(tmp_path / "full.pt"), _weights(tmp_path / "r.pt")
    assert all(torch.equal(wf[k], wr[k]) for k in wf)


def test_metrics_file_and_eval(tmp_path):
    r = run_swarm("train", *QUICK, "--steps", "2", "--save", "m.pt", "--metrics", "m.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "mAP@0.5 = " in r.stdout
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all({"step", "loss", "samples_per_s", "wall_s"} <= set(x) for x in lines)
    assert "step 2/2" in r.stderr  # progress
    e = run_swarm("eval", "--checkpoint", "m.pt", "--threads", "1", cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    assert "mAP@0.5 = " in e.stdout and "at step 2" in e.stdout


@pytest.mark.parametrize("args,message", [
    (["train", "--model", "yolov9"], "unknown model 'yolov9'"),
    (["train", "--img-size", "100"], "takes multiples of 16"),
    (["train", "--img-size", "608x"], "argument --img-size: '608x' is not a size: give N (a square) or WxH"),
    (["plan", "--img-size", "0x352"], "argument --img-size: width and height must be at least 1, got 0x352"),
    (["train", "--img-size", "600x352"], "its width and height each take multiples of 16 from 16 to 2048"),
    (["train", "--data", "/nonexistent/folder"], "does not exist"),
    (["train", "--steps", "0"], "must be at least 1"),
    (["train", "--batch-size", "x"], "is not a whole number"),
    (["train", "--strategy", "bogus"], "invalid choice"),
    (["train", "--resume", "missing.pt"], "does not exist"),
    (["eval", "--checkpoint", "missing.pt"], "does not exist"),
    (["train", "--steps", "2", "--epochs", "1"], "not both"),
    (["bogus"], "invalid choice"),
])
def test_user_mistakes_get_a_message_not_a_traceback(tmp_path, monkeypatch, capsys, args, message):
    """In this process (the command line's own entry, main): a fresh interpreter per mistake
    costs seconds each; test_the_largest_size_is_said and the next run one."""
    from swarm.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(args)
    except SystemExit as stop:  # argparse's errors
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # one line, not the usage text first


def test_the_largest_size_is_said(tmp_path):
    r = run_swarm("train", "--img-size", "4096", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "multiples of 16 from 16 to 2048" in r.stderr


def test_corrupt_checkpoint_for_resume(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    r = run_swarm("train", "--resume", "bad.pt", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "bad.pt is not a swarm checkpoint: it is a text file" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["train", "--model", "yolov9"], ["plan", "--model", "yolov9"],
                                  ["profile", "--model", "missing.cfg"], ["data", "anchors", ".", "--model", "yolov9"]])
def test_a_mistyped_model_is_refused_before_torch_loads(tmp_path, args):
    """A model name or .cfg path is checked as the flags are read: on a small device loading
    torch takes seconds, which a typo should not cost (a fresh interpreter, as a user's)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom swarm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as stop:\n"
             "    print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', stop.code)\n")
    r = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["torch", "not", "loaded", "2"], (r.stdout, r.stderr)
    assert "argument --model: " in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


FILE_MISTAKES = [
    (["eval", "--checkpoint", "notes.txt"], "notes.txt is not a swarm checkpoint: it is a text file"),
    (["export", "--checkpoint", "missing.pt", "--format", "onnx", "--out", "m.onnx"], "checkpoint missing.pt does not exist"),
    (["detect", "--checkpoint", "d.weights", "notes.txt"], "d.weights is not a swarm checkpoint: it looks like darknet"),
    (["detect", "--checkpoint", "old.pt", "nowhere"], "nowhere: no such file or folder"),
    (["train", "--resume", "notes.txt"], "notes.txt is not a swarm checkpoint: it is a text file"),
    (["train", "--model", "yolov2-16", "--weights", "notes.txt"], "neither darknet weights nor a swarm checkpoint"),
    (["train", "--resume", "old.pt", "--weights", "d.weights"], "give one of them"),
    (["train", "--model", "yolov2-16", "--data", "nowhere"], "data folder nowhere does not exist"),
    (["train", "--model", "yolov2-16", "--data", "notes.txt"], "--data notes.txt is not a folder"),
    (["train", "--model", "yolov2-16", "--img-size", "40"], "yolov2-16 cannot take --img-size 40"),
    (["train", "--img-size", "4096"], "yolov2-16 cannot take --img-size 4096"),  # the model trained without --model
]


def test_a_file_or_size_that_cannot_be_is_refused_before_torch_loads(tmp_path):
    """A checkpoint, weights file, data folder or image size that cannot be what it is given as
    is one line before torch is loaded (seconds on a small device), in the words the command
    would use after: every mistake of FILE_MISTAKES in turn, in one fresh interpreter."""
    import json
    import struct
    import subprocess
    import sys

    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "d.weights").write_bytes(struct.pack("<3iQ", 0, 2, 0, 0) + bytes(64))
    (tmp_path / "old.pt").write_bytes(b"PK\x03\x04")  # a torch file by its first bytes
    probe = ("import json, sys\nfrom swarm.cli import main\nfor args in json.loads(sys.argv[1]):\n"
             "    print(main(args), file=sys.stderr)\nprint('torch loaded' if 'torch' in sys.modules else 'torch not loaded')\n")
    r = subprocess.run([sys.executable, "-c", probe, json.dumps([args for args, _ in FILE_MISTAKES])], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "torch not loaded", (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 * len(FILE_MISTAKES), r.stderr  # a message and the exit status, each
    for (args, message), said, code in zip(FILE_MISTAKES, lines[::2], lines[1::2]):
        assert said.startswith(f"swarm {args[0]}: error: ") and message in said and code == "2", (args, said, code)
