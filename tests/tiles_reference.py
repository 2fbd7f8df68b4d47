"""The reference side of the tiles tests: float64 training through the real trainers, and tensor comparison."""
from __future__ import annotations

import dataclasses

import torch

from swarm.data import open_datasets, training_batch
from swarm.local.tiled import TiledTrainer
from swarm.local.trainer import LocalTrainer, TrainConfig


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def worst_state_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest relative L2 difference over the floating tensors; integer buffers must be equal."""
    assert set(a) == set(b)
    worst = (0.0, "")
    for k in a:
        if a[k].is_floating_point():
            worst = max(worst, (rel_diff(a[k], b[k]), k))
        else:
            assert torch.equal(a[k], b[k]), k
    return worst


def train_float64(cfg: TrainConfig, steps: int, grid=None, sync: str = "all", last: int | None = None) -> dict:
    """`steps` optimizer steps of LocalTrainer (grid None) or TiledTrainer (its stage layers
    [0, last), by default the longest tileable front) with --dtype float64,
    through the trainers' own step(): data order, micro-batches, loss, optimizer, lr schedule.

    float64 because float32 training of these BN networks is itself only reproducible to
    ~1e-2 in some tensors under any reordering of sums (even another thread count)."""
    cfg = dataclasses.replace(cfg, dtype="float64")
    trainer = LocalTrainer(cfg) if grid is None else TiledTrainer(cfg, grid=grid, sync=sync, last=last)
    train_set, _ = open_datasets(cfg.data, trainer.desc.img_size, trainer.desc.in_channels)
    for step in range(steps):
        trainer.step(*training_batch(trainer, train_set, step))
    return {k: v.clone() for k, v in trainer.net.state_dict().items()}
