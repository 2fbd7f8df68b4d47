"""Training on CUDA gives what the CPU gives (float64, deterministic cuDNN); skipped without a
CUDA device. The device-generic code these run is the code every CPU test runs: the device is
a parameter (swarm.local.compute_device), never a literal (checked below on any machine)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from swarm.data import open_datasets, training_batch
from swarm.local.trainer import LocalTrainer, TrainConfig

ROOT = Path(__file__).resolve().parent.parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _train(cfg: TrainConfig, trainer_class=LocalTrainer, steps: int = 3, **kw) -> dict:
    trainer = trainer_class(TrainConfig(**vars(cfg)), **kw)
    data, _ = open_datasets(None, cfg.img_size, 3)
    for s in range(steps):
        trainer.step(*training_batch(trainer, data, s))
    return {k: v.detach().cpu() for k, v in trainer.net.state_dict().items()}


def _worst(a: dict, b: dict) -> float:
    """The largest relative difference over the tensors. A tensor whose gradient is zero in exact
    arithmetic (the BatchNorm bias before another BatchNorm, which takes any constant away, in
    EfficientNet's linear bottlenecks, and the next BatchNorm's running mean that it moves)
    holds only rounding noise, norms of 1e-15 on an H200 and the CPU alike, which two devices'
    kernels round differently: a tensor is measured against its norm or 1e-3, whichever is
    larger (so 1e-9 is 1e-12 absolute there; every other tensor of EfficientNet-B0 agreed to
    3e-13 relative)."""
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-3))
               for k in a if a[k].is_floating_point())


def _cfg(accelerator: str, model: str = "yolov2-16") -> TrainConfig:
    return TrainConfig(model=model, img_size=64, batch_size=8, microbatches=2, seed=5, classes=5,
                       dtype="float64", accelerator=accelerator)


GRAPHS = [str(ROOT / "tests" / "cfg" / "darknet" / f"{name}.cfg") for name in ("yolov4-tiny", "resnet18", "efficientnet_b0")]


@needs_cuda
@pytest.mark.parametrize("model", ["yolov2-16", *GRAPHS], ids=lambda m: Path(m).stem)
def test_local_training_on_cuda_equals_the_cpu(model):
    """A chain, and graph networks: CSP route groups and two [yolo] heads, residual adds,
    depthwise convolutions with squeeze-and-excitation."""
    assert _worst(_train(_cfg("cuda", model)), _train(_cfg("cpu", model))) < 1e-9


@needs_cuda
def test_a_graph_network_across_a_cuda_part_and_a_cpu_part_equals_local():
    """yolov4-tiny cut inside a CSP block: the maps crossing (three of them) go through the host."""
    from planner.plan import Stage

    cfg = _cfg("cpu", GRAPHS[0])
    _assert_plan_equals_local(cfg, [Stage(0, 5, "single", ["d0"]), Stage(5, 38, "single", ["d1"])])


def _assert_plan_equals_local(cfg: TrainConfig, stages) -> None:
    """The stages as a plan in this process, d0 computing on CUDA and d1 on the CPU, against
    local training on the CPU."""
    from planner.plan import Plan
    from swarm.execution.inprocess import train_plan_in_process

    plan = Plan(cfg.model, 64, 8, 2, stages, devices={"d0": {"accelerator": "cuda"}, "d1": {}})
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, 64, 3)
    train_plan_in_process(plan, trainer, data, 3, timeout_s=120)
    ours = {k: v.detach().cpu() for k, v in trainer.net.state_dict().items()}
    assert _worst(ours, _train(cfg)) < 1e-9


@needs_cuda
def test_tiles_on_cuda_equal_untiled_on_the_cpu():
    from swarm.local.tiled import TiledTrainer

    tiled = _train(_cfg("cuda"), TiledTrainer, grid=(2, 2), sync="all")
    assert _worst(tiled, _train(_cfg("cpu"))) < 1e-9


def test_no_device_literal_where_the_work_is_done():
    """Execution, tiles and the trainers take their device as a parameter: a "cpu" (or
    "cuda") written into them would pin work to one device."""
    files = [*(ROOT / "swarm" / "execution").glob("*.py"), *(ROOT / "tiles").glob("*.py"),
             ROOT / "swarm" / "local" / "trainer.py", ROOT / "swarm" / "local" / "tiled.py"]
    found = [f"{f.relative_to(ROOT)}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
             if re.search(r"""["'](cpu|cuda)(:\d+)?["']""", line)]
    assert not found, found


@needs_cuda
@pytest.mark.parametrize("stages", ["pipeline", "dp"])
def test_a_plan_with_a_cuda_part_and_a_cpu_part_equals_local(stages):
    """Two devices in this process, d0 computing on CUDA (its plan facts say so) and d1 on
    the CPU: what crosses between them goes through the host once per message."""
    from planner.plan import Plan, Stage
    from swarm.execution.inprocess import train_plan_in_process

    cfg = _cfg("cpu")
    if stages == "pipeline":
        parts = [Stage(0, 8, "single", ["d0"]), Stage(8, 17, "single", ["d1"])]
    else:
        parts = [Stage(0, 17, "dp", ["d0", "d1"], allocation={"d0": 2, "d1": 2})]
    plan = Plan("yolov2-16", 64, 8, 2, parts, devices={"d0": {"accelerator": "cuda"}, "d1": {}})
    trainer = LocalTrainer(TrainConfig(**vars(cfg)))
    data, _ = open_datasets(None, 64, 3)
    train_plan_in_process(plan, trainer, data, 3, timeout_s=120)
    ours = {k: v.detach().cpu() for k, v in trainer.net.state_dict().items()}
    assert _worst(ours, _train(cfg)) < 1e-9


@needs_cuda
def test_the_profilers_cuda_layer_times_are_positive_and_ordered_like_the_flops():
    """Layers timed on the GPU by CUDA events: every time positive, the convolutions' times
    rising with their FLOPs; the profile carries the accelerator as a cluster file gives one."""
    import numpy as np

    from planner.cluster import accelerator_from_dict
    from swarm.profiling.profiler import profile_model
    from swarm.zoo import describe_model

    # maps large enough that a layer's time is its work, not the kernel launches around it
    profile = profile_model("yolov2-16", 320, batch_sizes=(4, 8), repeats=3, threads=1, device=torch.device("cuda"))
    costs = profile.costs
    assert (costs.fwd > 0).all() and (costs.bwd > 0).all() and all(t > 0 for t in profile.step_time.values())
    desc = describe_model("yolov2-16", 320, profile.classes)
    convs = [i for i, layer in enumerate(desc.layers) if layer.kind == "conv"]
    flops = [desc.layers[i].flops for i in convs]
    times = costs.fwd[convs, -1] + costs.bwd[convs, -1]
    ranks = [np.argsort(np.argsort(v)) for v in (np.array(flops), times)]
    assert np.corrcoef(*ranks)[0, 1] > 0.5  # rank correlation
    entry = profile.device["accelerator"]
    accelerator = accelerator_from_dict(entry, "profile")
    assert accelerator.kind == "cuda" and entry["copy_gbps"] > 0
    assert accelerator.shared_memory == torch.cuda.get_device_properties(0).is_integrated
    assert ("memory" in entry) != accelerator.shared_memory  # a discrete GPU's own budget; a Jetson's is the device's
    assert all(v > 0 for v in profile.peak_bytes.values())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LIVE = ["--model", "yolov2-16", "--img-size", "64", "--batch-size", "8", "--microbatches", "2", "--steps", "3",
        "--seed", "5", "--dtype", "float64", "--no-eval"]


@needs_cuda
@pytest.mark.slow
def test_agents_on_a_gpu_and_a_cpu_train_what_the_cpu_trains_alone(tmp_path):
    """The whole path a user takes: two `swarm join` processes on loopback, "gpu" offering
    cuda and "cpu0" its CPU; `swarm profile` on the GPU; `swarm train --plan` with a plan
    that puts gpu's layers on cuda (a pipeline, then dp over both), and `--strategy auto`,
    which profiles gpu on cuda. Each run's weights equal `--strategy local` on the CPU."""
    import subprocess
    import sys

    from planner.plan import Plan, Stage
    from tests.conftest import run_swarm

    r = run_swarm("profile", "--accelerator", "cuda", "--model", "yolov2-16", "--img-size", "64",
                  "--batch-sizes", "1,2", "--repeats", "1", "--state-dir", tmp_path / "p", "--out", tmp_path / "gpu.json",
                  timeout=300)
    assert r.returncode == 0, r.stderr
    assert "cuda" in r.stdout and '"kind": "cuda"' in (tmp_path / "gpu.json").read_text()
    token = tmp_path / "token"
    token.write_text(run_swarm("token", "--new").stdout)
    ports = {"gpu": _free_port(), "cpu0": _free_port()}
    env = dict(__import__("os").environ)
    env.setdefault("PYTHONPATH", str(ROOT))
    agents = [subprocess.Popen([sys.executable, "-m", "swarm", "join", "--name", name, "--port", str(port),
                                "--state-dir", str(tmp_path / name), "--token-file", str(token), "--no-mdns",
                                "--accelerator", "cuda" if name == "gpu" else "cpu"],
                               env=env, stderr=subprocess.DEVNULL)
              for name, port in ports.items()]
    try:
        common = ["--token-file", token, "--state-dir", tmp_path / "c", "--devices", "2", "--wait", "60",
                  "--peers", ",".join(f"127.0.0.1:{p}" for p in ports.values()), *LIVE]
        r = run_swarm("train", "--strategy", "local", "--accelerator", "cpu", *LIVE, "--save", tmp_path / "local.pt",
                      cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr
        local = torch.load(tmp_path / "local.pt", weights_only=True)["model"]
        plans = {"pipeline": [Stage(0, 8, "single", ["gpu"]), Stage(8, 17, "single", ["cpu0"])],
                 "dp": [Stage(0, 17, "dp", ["gpu", "cpu0"], allocation={"gpu": 2, "cpu0": 2})]}
        for name, stages in plans.items():
            plan = Plan("yolov2-16", 64, 8, 2, stages, devices={"gpu": {"accelerator": "cuda"}, "cpu0": {}})
            (tmp_path / f"{name}.json").write_text(plan.to_json())
            r = run_swarm("train", "--plan", tmp_path / f"{name}.json", *common, "--save", tmp_path / f"{name}.pt",
                          cwd=tmp_path, timeout=600)
            assert r.returncode == 0, r.stderr
            assert "gpu (cuda)" in r.stdout + r.stderr, r.stdout + r.stderr
            ours = torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]
            assert _worst(ours, local) < 1e-9, name
        r = run_swarm("train", "--strategy", "auto", *common, "--save", tmp_path / "auto.pt", cwd=tmp_path,
                      timeout=600)
        assert r.returncode == 0, r.stderr
        assert "gpu (cuda)" in r.stdout + r.stderr, r.stdout + r.stderr
        assert _worst(torch.load(tmp_path / "auto.pt", weights_only=True)["model"], local) < 1e-9
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            a.wait(timeout=30)


@needs_cuda
def test_tiles_over_residual_blocks_on_cuda_before_a_cpu_stage_equal_local():
    """resnet18's front — a 7x7/2 convolution, a max-pool, two residual blocks — as 2x2 tiles on
    CUDA, the rest on the CPU."""
    from planner.plan import Stage

    cfg = _cfg("cpu", GRAPHS[1])
    _assert_plan_equals_local(cfg, [Stage(0, 8, "tiles", ["d0"], grid=(2, 2), tile_devices=["d0"] * 4),
                                    Stage(8, 28, "single", ["d1"])])
