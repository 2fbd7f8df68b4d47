"""`swarm plot`: a run's --metrics lines as a picture, with re-plans and lost devices marked."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from swarm.errors import SwarmError
from swarm.local.metrics_plot import read_metrics
from tests.conftest import run_swarm


def _lines(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _step(step, epoch, devices, replayed=False):
    names = [f"dev{k}" for k in range(devices)]
    return {"step": step, "loss": 90.0 / step, "samples_per_s": 1.5 + 0.01 * step, "wall_s": 5.0 * step,
            "lr": 0.001, "utilisation": {n: 0.8 for n in names}, "epoch": epoch, "replayed": replayed,
            "devices": devices}


def test_replans_and_losses_are_found(tmp_path):
    path = tmp_path / "m.jsonl"
    # a device lost after step 4 (the new plan replays steps 4 and 5), one joins at step 9
    _lines(path, [_step(s, 0, 4) for s in range(1, 5)] + [_step(4, 1, 3, True), _step(5, 1, 3, True)]
           + [_step(s, 1, 3) for s in range(6, 9)] + [_step(s, 2, 4) for s in range(9, 11)])
    run = read_metrics(str(path))
    assert run.replans == [(4, "1 device lost"), (9, "1 joined")]
    assert run.replayed == [4, 5]
    assert [s for s, _ in run.utilisation["dev3"]] == [1, 2, 3, 4, 9, 10]


def test_the_picture_is_drawn(tmp_path):
    path, out = tmp_path / "m.jsonl", tmp_path / "m.png"
    _lines(path, [_step(s, 0 if s < 5 else 1, 4 if s < 5 else 3) for s in range(1, 12)])
    r = run_swarm("plot", path, "--out", out)
    assert r.returncode == 0, r.stderr
    assert f"picture: {out}" in r.stdout
    with Image.open(out) as image:
        assert image.format == "PNG" and image.width > 500 and image.height > 400


@pytest.mark.parametrize("content, says", [
    ('{"step": 1, "loss": 2.0, "samples_per_s": 1.0}\n{"step": 2, "loss"', "m.jsonl:2 is not a line of"),
    ("", "holds no steps"),
    (b"\x80\x03PK\x00", "is not a text file"),
])
def test_files_that_are_not_metrics_say_so(tmp_path, content, says):
    path = tmp_path / "m.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SwarmError, match=says):
        read_metrics(str(path))
    r = run_swarm("plot", path)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
