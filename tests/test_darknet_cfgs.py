"""Every network of darknet's own cfg folders (tests/cfg/darknet/) builds, trains a step on this
machine, and is planned by every planner, as a user who takes one from darknet would try it:
`swarm train --model FILE.cfg --img-size 64 --batch-size 2 --steps 1 --strategy local` and
`swarm plan --model FILE.cfg --compare`."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from swarm.data import make_batch, open_datasets, step_indices
from swarm.errors import SwarmError
from swarm.local.trainer import LocalTrainer, TrainConfig
from swarm.zoo import describe_model
from tests.conftest import ROOT, run_swarm

CFGS = sorted((Path(__file__).resolve().parent / "cfg" / "darknet").glob("*.cfg"))
SIZES = (64, 96)  # the smallest of these each takes (alexnet's windows need 96)


def _size(path: Path) -> int:
    for size in SIZES:
        try:
            describe_model(str(path), size)
            return size
        except SwarmError:
            continue
    raise AssertionError(f"{path.name} takes none of {SIZES}")


def test_the_folder_holds_darknets_networks():
    assert len(CFGS) == 43 and {"yolov4-tiny.cfg", "resnet18.cfg", "efficientnet_b0.cfg", "yolov7-tiny.cfg"} <= \
        {p.name for p in CFGS}


@pytest.mark.slow
@pytest.mark.parametrize("path", CFGS, ids=lambda p: p.stem)
def test_a_darknet_network_trains_a_step(path):
    size = _size(path)
    cfg = TrainConfig(model=str(path), img_size=size, batch_size=2, microbatches=1, seed=3, lr=1e-4, warmup=0)
    trainer = LocalTrainer(cfg)
    data, _ = open_datasets(None, trainer.desc.img_size, trainer.desc.in_channels)
    before = {k: v.clone() for k, v in trainer.net.state_dict().items() if v.is_floating_point()}
    loss = trainer.step(*make_batch(data, step_indices(len(data), 2, 0, 3)))
    assert math.isfinite(loss) and loss > 0
    moved = [k for k, v in trainer.net.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert len(moved) >= len(before) // 2, f"{len(moved)} of {len(before)} tensors moved"


@pytest.fixture(scope="module")
def flops_cluster(tmp_path_factory) -> Path:
    """The testbed's cluster file with its devices' speeds taken from FLOPs (no profile of this
    machine, which `swarm plan` would otherwise make for each network)."""
    cluster = json.loads((ROOT / "examples" / "testbed-cluster.json").read_text())
    cluster["reference"] = {"gflops": 8}
    path = tmp_path_factory.mktemp("cluster") / "testbed-flops.json"
    path.write_text(json.dumps(cluster))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("path", CFGS, ids=lambda p: p.stem)
def test_swarm_plan_compares_every_planner_on_a_darknet_network(path, flops_cluster):
    r = run_swarm("plan", "--model", path, "--img-size", _size(path), "--batch-size", 8, "--microbatches", 4,
                  "--devices", flops_cluster, "--compare", timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()}
    assert {"local", "dp", "pp", "asteroid", "auto"} <= set(rows), r.stdout
    assert "best" in rows["auto"], r.stdout
