"""Training on CUDA gives what the CPU gives (float64, deterministic cuDNN); skipped without a
CUDA device. The device-generic code these run is the code every CPU test runs: the device is
a parameter (swarm.local.compute_device), never a literal (checked below on any machine)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from swarm.data import make_batch, open_datasets, step_indices
from swarm.local.trainer import LocalTrainer, TrainConfig

ROOT = Path(__file__).resolve().parent.parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _train(cfg: TrainConfig, trainer_class=LocalTrainer, steps: int = 3, **kw) -> dict:
    trainer = trainer_class(TrainConfig(**vars(cfg)), **kw)
    data, _ = open_datasets(None, cfg.img_size, 3)
    for s in range(steps):
        trainer.step(*make_batch(data, step_indices(len(data), cfg.batch_size, s, cfg.seed)))
    return {k: v.detach().cpu() for k, v in trainer.net.state_dict().items()}


def _worst(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-30))
               for k in a if a[k].is_floating_point())


def _cfg(accelerator: str) -> TrainConfig:
    return TrainConfig(model="yolov2-16", img_size=64, batch_size=8, microbatches=2, seed=5, classes=5,
                       dtype="float64", accelerator=accelerator)


@needs_cuda
def test_local_training_on_cuda_equals_the_cpu():
    assert _worst(_train(_cfg("cuda")), _train(_cfg("cpu"))) < 1e-9


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

    profile = profile_model("yolov2-16", 128, batch_sizes=(2, 4), repeats=3, threads=1, device=torch.device("cuda"))
    costs = profile.costs
    assert (costs.fwd > 0).all() and (costs.bwd > 0).all() and all(t > 0 for t in profile.step_time.values())
    desc = describe_model("yolov2-16", 128, profile.classes)
    convs = [i for i, layer in enumerate(desc.layers) if layer.kind == "convolutional"]
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
