"""The local reference trainer: determinism, resume, micro-batches, checkpoints."""
from __future__ import annotations

import os

import pytest
import torch

from planner.image_size import ImageSize
from swarm.errors import SwarmError
from swarm.local.checkpoint import atomic_write, load_checkpoint, save_checkpoint
from swarm.local.trainer import TrainConfig, train

NO_BN_CFG = """[net]
width=32
height=32
channels=3

[convolutional]
filters=8
size=3
stride=1
pad=1
activation=leaky

[maxpool]
size=2
stride=2

[convolutional]
filters=8
size=3
stride=2
pad=1
activation=leaky

[connected]
output=5
activation=linear

[softmax]
"""


def _run(tmp_path, name, **kw):
    cfg = TrainConfig(**{"model": "yolov2-16", "img_size": 32, "batch_size": 4, "steps": 3, "seed": 1, **kw})
    save = tmp_path / f"{name}.pt"
    summary = train(cfg, save=str(save), threads=1, evaluate_at_end=False, log=lambda s: None)
    return load_checkpoint(save), summary


def _max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        if a[k].is_floating_point():
            worst = max(worst, float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)))
    return worst


def test_same_seed_gives_bit_identical_weights(tmp_path):
    a, _ = _run(tmp_path, "a")
    b, _ = _run(tmp_path, "b")
    c, _ = _run(tmp_path, "c", seed=2)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert not torch.equal(a["model"]["layers.0.conv.weight"], c["model"]["layers.0.conv.weight"])


def test_training_changes_weights_and_records_the_step(tmp_path):
    from swarm.zoo import build_model

    ckpt, summary = _run(tmp_path, "a")
    init, _, _ = build_model("yolov2-16", 32, classes=5, seed=1)
    assert ckpt["step"] == 3 and summary["steps"] == 3
    assert ckpt["model_name"] == "yolov2-16" and ckpt["img_size"] == ImageSize(32, 32)
    assert set(ckpt["model"]) == set(init.state_dict())
    assert not torch.equal(ckpt["model"]["layers.0.conv.weight"], init.state_dict()["layers.0.conv.weight"])
    # BN running statistics advanced once per micro-batch
    assert int(ckpt["model"]["layers.0.bn.num_batches_tracked"]) == 3


def test_resume_equals_uninterrupted(tmp_path):
    full, _ = _run(tmp_path, "full", steps=5)
    _run(tmp_path, "part", steps=2)
    cfg = TrainConfig(model="yolov2-16", img_size=32, batch_size=4, steps=5, seed=1)
    state = load_checkpoint(tmp_path / "part.pt")
    train(cfg, state=state, save=str(tmp_path / "part.pt"), threads=1, evaluate_at_end=False, log=lambda s: None)
    resumed = load_checkpoint(tmp_path / "part.pt")
    assert resumed["step"] == 5
    assert all(torch.equal(full["model"][k], resumed["model"][k]) for k in full["model"])


def test_microbatches_accumulate_to_the_full_batch_gradient(tmp_path):
    cfg_path = tmp_path / "nobn.cfg"
    cfg_path.write_text(NO_BN_CFG)
    one, _ = _run(tmp_path, "one", model=str(cfg_path), microbatches=1, batch_size=6)
    three, _ = _run(tmp_path, "three", model=str(cfg_path), microbatches=3, batch_size=6)
    assert _max_rel_diff(three["model"], one["model"]) < 1e-5


def test_batchnorm_statistics_are_per_microbatch(tmp_path):
    one, _ = _run(tmp_path, "one", microbatches=1)
    two, _ = _run(tmp_path, "two", microbatches=2)
    assert int(two["model"]["layers.0.bn.num_batches_tracked"]) == 6
    assert _max_rel_diff(two["model"], one["model"]) > 1e-4


def test_dropout_masks_do_not_depend_on_microbatching(tmp_path):
    cfg_path = tmp_path / "drop.cfg"
    cfg_path.write_text(NO_BN_CFG.replace("[softmax]", "[dropout]\nprobability=0.5\n\n[connected]\noutput=5\n"
                                          "activation=linear\n\n[softmax]"))
    one, _ = _run(tmp_path, "one", model=str(cfg_path), microbatches=1, batch_size=6)
    two, _ = _run(tmp_path, "two", model=str(cfg_path), microbatches=2, batch_size=6)
    assert _max_rel_diff(two["model"], one["model"]) < 1e-5


def test_checkpoint_loads_with_weights_only(tmp_path):
    _run(tmp_path, "a")
    state = torch.load(tmp_path / "a.pt", weights_only=True)
    assert {"model", "optimizer", "step", "model_name", "img_size"} <= set(state)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(2)}, "optimizer": {}, "step": 1, "model_name": "m", "img_size": 8})

    def dies_halfway(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, dies_halfway)
    assert load_checkpoint(path)["step"] == 1
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00not a checkpoint")
    with pytest.raises(SwarmError, match="is not a swarm checkpoint: it is not a torch file"):
        load_checkpoint(bad)
    torch.save({"hello": 1}, tmp_path / "other.pt")
    with pytest.raises(SwarmError, match="not a swarm checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_diverging_loss_stops_with_advice(tmp_path):
    with pytest.raises(SwarmError, match="smaller --lr"):
        _run(tmp_path, "x", lr=1e6, warmup=0, steps=5)


@pytest.mark.parametrize("every_s, saves", [(0.0, 1), (1e-9, 3)])
def test_a_local_run_saves_its_checkpoint_by_time(tmp_path, monkeypatch, every_s, saves):
    """Besides --save-every N, a run on this machine writes its checkpoint whenever the last
    one is older than save_every_s (swarm train: ten minutes), and at the end."""
    from swarm.local import trainer as module

    written = []
    monkeypatch.setattr(module, "save_checkpoint", lambda path, state: written.append(state["step"]))
    cfg = TrainConfig(model="lenet5", batch_size=4, steps=3, seed=1)
    train(cfg, save=str(tmp_path / "t.pt"), threads=1, evaluate_at_end=False, save_every_s=every_s,
          log=lambda s: None)
    assert len(written) == saves and written[-1] == 3
    assert module.SAVE_EVERY_S == 600.0


def test_a_held_out_problem_does_not_hide_the_saved_model(tmp_path, monkeypatch):
    from swarm.local import evaluate

    def broken(*args, **kw):
        raise SwarmError("val/img3.jpg: cannot decode the image")
    monkeypatch.setattr(evaluate, "evaluate", broken)
    cfg = TrainConfig(model="lenet5", batch_size=4, steps=2, seed=1)
    summary = train(cfg, save=str(tmp_path / "t.pt"), threads=1, log=lambda s: None)
    assert summary["eval"] is None and "cannot decode" in summary["eval_error"]
    assert load_checkpoint(tmp_path / "t.pt")["step"] == 2


STEPS_WITHOUT_DYNAMO = """
import sys
import torch
from swarm.local.trainer import TrainConfig, make_optimizer, optimizer_step
from swarm.zoo import build_model

plain = sys.argv[1] == "plain"
out = {}
for name in ("sgd", "adam"):
    net = build_model("yolov2-16", 64, seed=3)[0]
    opt = make_optimizer(net.named_parameters(), TrainConfig(optimizer=name, weight_decay=5e-4))
    for i in range(3):
        net(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step() if plain else optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
    opt.load_state_dict(opt.state_dict())
    out[name] = {"model": net.state_dict(), "optimizer": opt.state_dict()}
torch.save(out, sys.argv[2])
print("torch._dynamo" in sys.modules)
"""


def test_optimizers_step_without_importing_dynamo_and_to_the_same_weights(tmp_path):
    """swarm's optimizer steps leave torch._dynamo unimported (1.6 s of CPU and 71 MiB per
    training process) and give torch's own steps' weights and state, bit for bit."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    results = {}
    for way in ("plain", "swarm"):
        r = subprocess.run([sys.executable, "-c", STEPS_WITHOUT_DYNAMO, way, str(tmp_path / f"{way}.pt")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr
        results[way] = (r.stdout.strip(), torch.load(tmp_path / f"{way}.pt", weights_only=True))
    assert results["plain"][0] == "True" and results["swarm"][0] == "False"
    for name in ("sgd", "adam"):
        plain, ours = results["plain"][1][name], results["swarm"][1][name]
        assert all(torch.equal(plain["model"][k], ours["model"][k]) for k in plain["model"])
        for k, state in plain["optimizer"]["state"].items():
            assert all(torch.equal(v, ours["optimizer"]["state"][k][n]) for n, v in state.items()), (name, k)


def test_the_learning_rate_drops_a_tenth_at_each_step_given():
    cfg = TrainConfig(lr=0.01, warmup=4, lr_drops=[6, 8])
    assert [round(cfg.lr_at(s), 10) for s in range(10)] == [0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01, 0.001, 0.001,
                                                            0.0001, 0.0001]
    cfg = TrainConfig(lr=0.01, warmup=0)
    cfg.resolve_lr_drops(1000)
    assert cfg.lr_drops == [800, 900]  # darknet's yolo cfgs: steps at 80% and 90% of max_batches
    cfg.resolve_lr_drops(50)
    assert cfg.lr_drops == [800, 900]  # fixed once a run has started (a resumed run keeps them)
    assert TrainConfig(lr=0.01, warmup=0, lr_drops=[]).lr_at(10**6) == 0.01


def test_a_run_drops_its_learning_rate_near_its_end_unless_told_not_to(tmp_path):
    import json

    from swarm.cli import build_parser
    from swarm.commands.train_cmd import run_flags

    for drops, want in ((None, [8, 9]), ([], [])):
        metrics = tmp_path / f"m{drops}.jsonl"
        train(TrainConfig(model="lenet5", batch_size=4, steps=10, warmup=0, lr=0.01, lr_drops=drops), threads=1,
              save=str(tmp_path / "c.pt"), metrics=str(metrics), evaluate_at_end=False, log=lambda s: None)
        lrs = [json.loads(line)["lr"] for line in metrics.read_text().splitlines()]
        assert [k for k in range(1, 10) if lrs[k] < lrs[k - 1]] == want
        assert load_checkpoint(str(tmp_path / "c.pt"))["config"]["lr_drops"] == want
    args = build_parser().parse_args(["train", "--lr-drops", "80,90"])
    assert args.lr_drops == [80, 90] and run_flags(args) == ["--lr-drops", "80,90"]
    assert run_flags(build_parser().parse_args(["train", "--lr-drops", "none"])) == ["--lr-drops", "none"]


def test_omp_num_threads_caps_the_compute_threads(monkeypatch):
    """A user's OMP_NUM_THREADS (how a shared machine keeps a program's threads down; torch's
    own default honours it) caps the threads swarm computes on when not told, and no more: the
    cores a device reports stay its usable cores."""
    import torch

    from swarm.host.resources import compute_threads, usable_cores
    from swarm.local.trainer import set_threads

    cores = usable_cores()
    for value, expected in (("1", 1), ("64", cores), ("0", cores), ("two", cores), ("", cores)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert compute_threads() == expected, value
        assert usable_cores() == cores
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_threads(None) == 1 and torch.get_num_threads() == 1
        assert set_threads(2) == 2  # --threads has the last word
    finally:
        torch.set_num_threads(before)
