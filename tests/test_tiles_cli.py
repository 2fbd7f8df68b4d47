"""`swarm train --strategy tiles`: the issue's command against --strategy local, and the user's mistakes."""
from __future__ import annotations

import pytest
import torch

from swarm.cli import main
from tests.conftest import LocalRun, run_swarm
from tests.tiles_reference import rel_diff

COMMON = ["--img-size", "128", "--steps", "3", "--seed", "1", "--no-eval", "--threads", "1"]


def _diffs(a: dict, b: dict) -> dict[str, float]:
    assert set(a) == set(b)
    out = {}
    for k in a:
        if a[k].is_floating_point():
            out[k] = rel_diff(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k  # num_batches_tracked
    return out


@pytest.mark.slow
def test_done_when_command_in_float64_equals_local(tmp_path):
    """The issue's command, with --dtype float64: tiles and local checkpoints agree to 1e-5
    (measured ~2e-12)."""
    f64 = [*COMMON, "--dtype", "float64"]
    local = LocalRun(tmp_path / "l.pt", *f64)  # one thread each: the two runs take a core each
    t = run_swarm("train", "--strategy", "tiles", "--grid", "2x2", "--in-process", *f64, "--save", "t.pt", cwd=tmp_path)
    assert t.returncode == 0, t.stderr
    ct, cl = torch.load(tmp_path / "t.pt", weights_only=True), local.checkpoint()
    diffs = _diffs(ct["model"], cl["model"])
    assert max(diffs.values()) <= 1e-5, max(diffs.items(), key=lambda kv: kv[1])
    assert ct["step"] == cl["step"] == 3 and ct["config"] == cl["config"]


@pytest.mark.slow
def test_tiles_in_process_checkpoint_matches_local(tmp_path):
    """The issue's 'done when' command, in float32 as the CLI trains.

    Float32 cannot show 1e-5 here, for any implementation that sums in another order: two
    *local* runs differing only in --threads (2 vs 1) differ by 5.6e-3 (layers.0.bn.bias),
    and the tiles executor on a 1x1 grid -- no tiling at all, only its own arithmetic --
    differs from local by 5.6e-2, as much as 2x2 tiles do (5.2e-2; 2x2 vs 1x1: 6.6e-2).
    BatchNorm bias gradients are sums that nearly cancel, and max-pool choices between
    equal pixels of the synthetic images' flat regions follow last-bit rounding. So this
    test checks the checkpoint format and a float32-sized agreement; the 1e-5 equality is the
    float64 test above, and tests/test_tiles_exact.py (agreement ~1e-13)."""
    local = LocalRun(tmp_path / "l.pt", *COMMON)  # one thread each: the two runs take a core each
    t = run_swarm("train", "--strategy", "tiles", "--grid", "2x2", "--in-process", *COMMON, "--save", "t.pt", cwd=tmp_path)
    assert t.returncode == 0, t.stderr
    assert "tiles: layers 0-16 on a 2x2 grid" in t.stderr
    ct, cl = torch.load(tmp_path / "t.pt", weights_only=True), local.checkpoint()
    assert {k: v for k, v in ct.items() if k not in ("model", "optimizer")} == \
        {k: v for k, v in cl.items() if k not in ("model", "optimizer")}
    assert {k: (v.shape, v.dtype) for k, v in ct["model"].items()} == {k: (v.shape, v.dtype) for k, v in cl["model"].items()}
    diffs = _diffs(ct["model"], cl["model"])  # integer buffers (num_batches_tracked) must be equal
    weights = [k for k in diffs if k.endswith("conv.weight")]
    print(f"tiles vs local (float32): worst {max(diffs.values()):.1e}, conv weights {max(diffs[k] for k in weights):.1e}")
    assert max(diffs[k] for k in weights) < 2e-3 and max(diffs.values()) < 0.2
    assert t.stdout.split("(loss")[1].split(")")[0] == local.process().stdout.split("(loss")[1].split(")")[0]


@pytest.mark.parametrize("args,message", [
    (["--strategy", "tiles", "--grid", "2x2", "--wait", "0"], "add --in-process"),
    (["--strategy", "tiles", "--in-process"], "needs --grid ROWSxCOLS"),
    (["--strategy", "tiles", "--grid", "3", "--in-process"], "--grid takes ROWSxCOLS such as 2x2 or 2x3, got '3'"),
    (["--strategy", "tiles", "--grid", "0x2", "--in-process"], "at least one row and one column, got '0x2'"),
    (["--strategy", "tiles", "--grid", "3x3", "--in-process"], "grid with 3 rows does not fit: layer 16's output "
                                                                "has only 2 rows"),
    (["--strategy", "tiles", "--grid", "2x2", "--sync", "0,x", "--in-process"], "'x' is not a layer number"),
    (["--strategy", "tiles", "--grid", "2x2", "--sync", "3,40", "--in-process"], "layer(s) 40 are not in the "
                                                                                  "tiles stage (layers 0-16)"),
    (["--grid", "2x2"], "--grid apply to --strategy tiles and hybrid only"),
])
def test_mistakes_get_a_message(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--img-size", "32", "--steps", "1", "--batch-size", "2", "--no-eval", "--threads", "1",
                 *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
