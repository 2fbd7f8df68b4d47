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
def test_every_planner_answers_for_a_darknet_network(path, flops_cluster):
    """What `swarm plan --compare` runs, in this process: every planner gives a plan or says
    why not, and auto's is one that fits."""
    from planner.cluster import cluster_from_dict
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel
    from planner.planners import compare

    desc = describe_model(str(path), _size(path))
    cluster = cluster_from_dict(json.loads(flops_cluster.read_text()), desc, lambda spec: None)
    rows = {row.strategy: row for row in compare(PlanInputs(desc, MemoryModel.for_devices(desc), cluster, 8, 4))}
    assert {"local", "dp", "pp", "asteroid", "auto"} <= set(rows)
    assert rows["auto"].plan is not None, rows["auto"].error
    rows["auto"].plan.validate(desc)
    for row in rows.values():
        assert row.plan is not None or (row.error and "\n" not in row.error), row


@pytest.mark.parametrize("name", ["yolov4-tiny", "resnet18"])
def test_swarm_plan_compare_on_a_darknet_network(name, flops_cluster):
    path = CFGS[0].parent / f"{name}.cfg"
    r = run_swarm("plan", "--model", path, "--img-size", 64, "--batch-size", 8, "--microbatches", 4,
                  "--devices", flops_cluster, "--compare", timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()}
    assert {"local", "dp", "pp", "tiles", "asteroid", "auto"} <= set(rows), r.stdout
    assert "best" in rows["auto"], r.stdout
