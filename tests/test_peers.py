"""The peers (bench/peers/ddp.py, pipe.py) train what swarm's local trainer trains, and bench/versus.py's flags.

No testbed and no root: the peers run under torchrun with two local ranks on loopback. lenet5
has no BatchNorm (which plain DDP keeps per rank), so DDP's weights after two SGD steps over
ranks must equal LocalTrainer's on the same global batches, up to float rounding. torch's
pipeline keeps BatchNorm per micro-batch, as swarm does, so pipe.py's two stages of yolov2-16
must end with LocalTrainer's weights and statistics bit for bit.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

# batch 5 over 2 ranks: shares of 3 and 2 samples, each in 2 micro-batches (one of them of 1)
TINY = {"model": "lenet5", "img_size": 64, "batch_size": 5, "microbatches": 2, "steps": 2, "seed": 1, "lr": 0.1,
        "warmup": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def torchrun_ddp(settings: dict, *extra, script: str = "ddp.py") -> None:
    """A peer (ddp.py unless `script` says) under torchrun on 2 local ranks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), str(ROOT / "bench" / "peers" / script),
                        *flags(settings), *map(str, extra)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """ddp.py on 2 local ranks for TINY: (metrics lines, trained weights)."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun_ddp(TINY, "--metrics", out / "m.jsonl", "--save", out / "w.pt")
    lines = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    return lines, torch.load(out / "w.pt", weights_only=True)


def test_ddp_carries_on_from_its_checkpoint(ddp_run, tmp_path):
    """A worker restarted after step 1 (as torchrun's elastic agent restarts it) resumes from
    rank 0's checkpoint and ends with the weights of the run that was never stopped."""
    checkpoint = tmp_path / "ddp.ckpt"
    torchrun_ddp({**TINY, "steps": 1}, "--checkpoint", checkpoint)
    assert torch.load(checkpoint, weights_only=True)["step"] == 1
    torchrun_ddp(TINY, "--checkpoint", checkpoint, "--metrics", tmp_path / "m.jsonl", "--save", tmp_path / "w.pt")
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [2]
    resumed, whole = torch.load(tmp_path / "w.pt", weights_only=True), ddp_run[1]
    for k, v in whole.items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-6, atol=1e-7)


def test_ddp_writes_one_metrics_line_per_step(ddp_run):
    lines, _ = ddp_run
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["samples"] == TINY["batch_size"]
        assert m["seconds"] > 0 and m["samples_per_s"] == pytest.approx(m["samples"] / m["seconds"])
        assert torch.isfinite(torch.tensor(m["loss"]))
        assert len(m["rank_cpu_s"]) == 2
        # the main thread's CPU is part of its rank's, and each rank's own (not another's)
        assert len(m["rank_main_cpu_s"]) == 2
        assert all(0 < main <= cpu + 1e-3 for main, cpu in zip(m["rank_main_cpu_s"], m["rank_cpu_s"]))


def train_locally(settings: dict) -> tuple[dict, list[float], dict]:
    """LocalTrainer's run of `settings`: (its first weights, each step's loss, its last weights);
    without augmentation, as the peers train."""
    from swarm.data import training_batch
    from swarm.local.trainer import LocalTrainer, TrainConfig, prepare

    torch.set_num_threads(1)
    cfg, train_set, _ = prepare(TrainConfig(**{**settings, "augment": False}))
    trainer = LocalTrainer(cfg)
    start = {k: v.clone() for k, v in trainer.net.state_dict().items()}
    losses = [trainer.step(*training_batch(trainer, train_set, s))
              for s in range(cfg.steps)]
    return start, losses, trainer.net.state_dict()


def test_ddp_equals_local_training_without_batchnorm(ddp_run):
    lines, weights = ddp_run
    start, losses, local = train_locally(TINY)
    assert [m["loss"] for m in lines] == pytest.approx(losses, rel=1e-5)
    assert local.keys() == weights.keys()
    for k, v in local.items():
        assert (v - start[k]).abs().max() > 1e-4, f"{k} hardly moved: the comparison would prove nothing"
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6)


# batch 4 in 2 micro-batches of 2, two stages of yolov2-16 (15 BatchNorm layers) at 64
PIPE_TINY = {"model": "yolov2-16", "img_size": 64, "batch_size": 4, "microbatches": 2, "steps": 2, "seed": 1,
             "lr": 0.1, "warmup": 0}


@pytest.fixture(scope="module")
def pipe_run(tmp_path_factory):
    """pipe.py on 2 local ranks (two stages) for PIPE_TINY: (metrics lines, trained weights)."""
    out = tmp_path_factory.mktemp("pipe")
    torchrun_ddp(PIPE_TINY, "--metrics", out / "m.jsonl", "--save", out / "w.pt", script="pipe.py")
    lines = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    return lines, torch.load(out / "w.pt", weights_only=True)


def test_pipe_equals_local_training_bit_for_bit(pipe_run):
    """Weights, BatchNorm statistics and losses after two steps, as LocalTrainer has them (torch
    infers the shapes between stages by running a stage once, which would move the first
    stage's statistics a step further: pipe.py gives the shapes instead)."""
    lines, weights = pipe_run
    start, losses, local = train_locally(PIPE_TINY)
    assert [m["loss"] for m in lines] == losses
    assert lines[0]["stage_firsts"][0] == 0 and len(lines[0]["stage_firsts"]) == 2
    assert local.keys() == weights.keys()
    for k, v in local.items():
        assert not torch.equal(v, start[k]), f"{k} did not change: the comparison would prove nothing"
        assert torch.equal(weights[k], v), k


def test_pipe_writes_one_metrics_line_per_step(pipe_run):
    lines, _ = pipe_run
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["samples"] == PIPE_TINY["batch_size"] and m["ranks"] == 2
        assert m["samples_per_s"] == pytest.approx(m["samples"] / m["seconds"])
        assert all(0 < main <= cpu + 1e-3 for main, cpu in zip(m["rank_main_cpu_s"], m["rank_cpu_s"]))


def load_pipe():
    import importlib.util
    sys.path.insert(0, str(ROOT / "bench" / "peers"))
    try:
        spec = importlib.util.spec_from_file_location("pipe_peer", ROOT / "bench" / "peers" / "pipe.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench" / "peers"))


def test_pipe_splits_the_layers_into_stages_of_least_largest_flops():
    import itertools
    import random

    even_split = load_pipe().even_split
    assert even_split([1, 1, 1, 1], 2) == [0, 2]
    assert even_split([4, 1, 1, 1, 1], 2) == [0, 1]
    assert even_split([1, 1, 1], 3) == [0, 1, 2]
    rng = random.Random(1)
    for _ in range(200):
        flops = [rng.randint(1, 20) for _ in range(rng.randint(1, 8))]
        stages = rng.randint(1, len(flops))
        firsts = even_split(flops, stages)
        assert firsts[0] == 0 and len(firsts) == stages and firsts == sorted(set(firsts))

        def largest(cuts):
            bounds = [*cuts, len(flops)]
            return max(sum(flops[a:b]) for a, b in zip(bounds, bounds[1:]))

        best = min(largest([0, *rest]) for rest in itertools.combinations(range(1, len(flops)), stages - 1))
        assert largest(firsts) == best, (flops, stages, firsts)


@pytest.mark.parametrize("bad, says", [(["--split", "3,x"], "--split"),
                                       (["--batch-size", "6", "--microbatches", "4"], "equal micro-batches"),
                                       (["--model", "lenet5", "--img-size", "64", "--split", "3,5"], "one rank runs"),
                                       (["--model", "alexnet"], "dropout")])
def test_pipe_bad_flags_are_one_line(bad, says):
    r = run_script(ROOT / "bench" / "peers" / "pipe.py", *bad)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("bad, says", [(["--steps", "0"], "--steps"), (["--batch-size", "x"], "--batch-size"),
                                       (["--model", "lenet5", "--img-size", "3"], "--img-size 3")])
def test_ddp_bad_flags_are_one_line(bad, says):
    r = run_script(ROOT / "bench" / "peers" / "ddp.py", *bad)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


def test_versus_help():
    r = run_script(ROOT / "bench" / "versus.py", "--help")
    assert r.returncode == 0, r.stderr
    assert "--runs" in r.stdout and "--cpu 0.1,0.1,0.2,0.2,0.4,0.6" in r.stdout


@pytest.mark.parametrize("bad, says", [(["--kill", "dev0"], "--kill must be one of dev1"),
                                       (["--steps", "4", "--kill-after-step", "3"], "at least two steps after it"),
                                       (["--runs", "fast"], "--runs")])
def test_versus_kill_bad_flags_are_one_line(bad, says):
    r = run_script(ROOT / "bench" / "versus_kill.py", *bad)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


@pytest.mark.parametrize("bad", [["--runs", "auto,fast"], ["--runs", "dp,dp"], ["--devices", "6", "--cpu", "0.1,0.2"],
                                 ["--runs", "ddp@glibc"], ["--runs", "auto,auto@jemalloc"]])
def test_versus_bad_flags_are_one_line(bad):
    r = run_script(ROOT / "bench" / "versus.py", *bad)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("versus.py: error:"), r.stderr


def test_a_versus_run_on_glibc_starts_its_testbed_and_commands_on_glibc_and_only_it(monkeypatch):
    """`auto@glibc`: the agents (started by `swarm testbed up` in bench.ENV), the command in
    dev0's namespace and `alone`'s trainings (os.environ) run with SWARM_MALLOC=glibc; the run
    after it as before."""
    import types
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import versus
    monkeypatch.delenv("SWARM_MALLOC", raising=False)
    bench = types.SimpleNamespace(ENV={"SWARM_MALLOC": "jemalloc"})
    seen = []
    monkeypatch.setattr(versus, "_measure", lambda bench, name, *_: seen.append(
        (name, bench.ENV.get("SWARM_MALLOC"), os.environ.get("SWARM_MALLOC"))))
    for name in ("auto@glibc", "auto", "alone@glibc"):
        versus.measure(bench, name, None, None, name)
    assert seen == [("auto@glibc", "glibc", "glibc"), ("auto", "jemalloc", None), ("alone@glibc", "glibc", "glibc")]
    assert bench.ENV == {"SWARM_MALLOC": "jemalloc"} and "SWARM_MALLOC" not in os.environ
    assert versus.base_run("auto@glibc") == "auto" and versus.run_list("ddp,auto,auto@glibc")[2] == "auto@glibc"


def test_versus_keeps_each_devices_log(tmp_path, monkeypatch):
    """--logs: each device's agent log, and the coordinator's output, are copied out before the next
    run's testbed replaces them."""
    import types
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import versus
    logs = {}
    for name in ("dev0", "dev1"):
        logs[name] = tmp_path / f"{name}.log"
        logs[name].write_text(f"{name}: listening\nkilled for memory\n")
    devices = [types.SimpleNamespace(name=n, log=str(p)) for n, p in logs.items()]
    devices.append(types.SimpleNamespace(name="dev2", log=str(tmp_path / "never-started.log")))
    monkeypatch.setattr(versus.testbed, "require", lambda: types.SimpleNamespace(devices=devices))
    versus.keep_logs(tmp_path / "kept" / "auto-1", "plan (dp)\nre-planned from epoch 0\n")
    kept = sorted(p.name for p in (tmp_path / "kept" / "auto-1").iterdir())
    assert kept == ["coordinator.log", "dev0.log", "dev1.log"]
    assert (tmp_path / "kept" / "auto-1" / "coordinator.log").read_text() == "plan (dp)\nre-planned from epoch 0\n"
    assert (tmp_path / "kept" / "auto-1" / "dev1.log").read_text() == logs["dev1"].read_text()


def test_versus_reads_the_prediction_swarm_train_prints_under_its_plan(monkeypatch):
    """bench/versus.py reports, for an auto run, what the planner predicted for the plan that
    run started with, as swarm train printed it (not what `swarm plan` predicts afterwards,
    which profiles again and may plan otherwise); a re-costed plan later in the output is
    not taken for the first, and a run that printed no prediction gives none."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import versus
    from planner.baselines import simple_plan
    from swarm.execution.launch import prediction_line
    from swarm.zoo import describe_model

    plan = simple_plan("dp", describe_model("yolov2-16", 416), ["dev0", "dev1"], 8, 8)
    plan.predicted = {"throughput": 3.2341836, "step_time_s": 9.8943}
    later = simple_plan("dp", describe_model("yolov2-16", 416), ["dev1"], 8, 8)
    text = "\n".join([plan.describe(), prediction_line(plan, True), "step 1/4 [#---] loss 851.5",
                      "step 2: measured compute against the profiles: dev0 1.52x, dev1 1.04x; re-planning",
                      "re-costed " + later.describe(), "step 4/4 [####] loss 20"])
    out = versus.read_output(text)
    assert out["predicted_samples_per_s"] == 3.234 and out["predicted_step_s"] == 9.89
    assert out["plan"] == [line.strip() for line in plan.describe().splitlines()]
    assert out["recost"][0].startswith("step 2: measured compute") and len(out["recost"]) == 3
    assert prediction_line(plan, False).startswith("predicted on estimates: 3.234 samples/s")
    plan.predicted = {}
    assert prediction_line(plan, True) is None
    assert "predicted_samples_per_s" not in versus.read_output(plan.describe())


def test_versus_sets_each_run_against_alone_and_ddp_round_by_round(monkeypatch):
    """The lines under the table: each run's median over alone's and ddp's, and each round's ratio
    (its runs ran next to each other); a failed round is a dash and counts in no median."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import versus

    def rounds(*rates):
        return [{"error": "killed"} if r is None else {"samples_per_s": r} for r in rates]

    results = {"alone": rounds(2.0, 1.6), "ddp": rounds(1.0, 0.8), "auto": rounds(1.2, None)}
    assert versus.against(results) == [
        "against alone (medians; each round): ddp 0.50x (0.50, 0.50); auto 0.67x (0.60, -)",
        "against ddp (medians; each round): alone 2.00x (2.00, 2.00); auto 1.33x (1.20, -)"]
    assert versus.against({"ddp": rounds(None), "auto": rounds(1.0)}) == []
    assert versus.against({"auto": rounds(1.0)}) == []
