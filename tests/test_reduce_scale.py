"""dp over 32 to 64 devices in one process gives the local trainer's weights (float64,
after real optimizer steps): the gradient sums of a large group (halving and doubling, or a
ring) and, with BatchNorm, a gang of 64 gathering its statistics at every BN layer."""
from __future__ import annotations

import pytest

from planner.baselines import simple_plan
from swarm.data import open_datasets, training_batch
from swarm.execution.inprocess import train_plan_in_process
from swarm.local.trainer import LocalTrainer, TrainConfig
from tests.test_execution import SMALL_CLASSIFIER, _worst

STEPS = 2


def _local_and_dp(model: str, channels: int, devices: int) -> tuple[dict, dict]:
    """The weights after STEPS steps of batch 64 trained by dp over `devices` in-process
    devices, and locally."""
    cfg = TrainConfig(model=model, img_size=32, batch_size=64, microbatches=1, seed=7, classes=5,
                      dtype="float64", accelerator="cpu")
    data, _ = open_datasets(None, cfg.img_size, channels)
    local = LocalTrainer(TrainConfig(**vars(cfg)))
    for s in range(STEPS):
        local.step(*training_batch(local, data, s))
    planned = LocalTrainer(TrainConfig(**vars(cfg)))
    plan = simple_plan("dp", planned.desc, [f"d{i}" for i in range(devices)], cfg.batch_size, cfg.microbatches)
    assert len(plan.stages[0].devices) == devices  # one group, every device with samples
    train_plan_in_process(plan, planned, data, STEPS, timeout_s=120)
    return planned.net.state_dict(), local.net.state_dict()


@pytest.mark.parametrize("devices", [32, 48])  # halving and doubling; a ring
def test_dp_over_many_devices_equals_local(devices):
    planned, local = _local_and_dp("lenet5", 1, devices)
    assert _worst(planned, local)[0] < 1e-9


def test_a_batchnorm_gang_of_64_equals_local(tmp_path):
    """Every member's compute thread waits at each BN exchange for the other 63."""
    path = tmp_path / "small.cfg"
    path.write_text(SMALL_CLASSIFIER)
    planned, local = _local_and_dp(str(path), 3, 64)
    assert _worst(planned, local)[0] < 1e-9
