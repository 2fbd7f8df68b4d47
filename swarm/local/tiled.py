"""In-process tiled training: the local trainer, with the tileable front of the network run as a grid of tiles.

The tiles stage is layers [0, last) for the longest tileable prefix (tiles.layout.tileable_prefix:
windows, and the shortcuts, routes and upsamples of residual and CSP blocks), or a shorter one
asked for; its tiles run one after another in this process (tiles.whole_stage.InProcessStage) and the rest
of the network, the loss, the optimizer, the data order and the checkpoints are the local
trainer's. The result equals `--strategy local` up to floating-point reordering.
"""
from __future__ import annotations

import numpy as np
import torch

from swarm.errors import SwarmError
from swarm.local.trainer import LocalTrainer, TrainConfig
from tiles.grouping import Grouping, parse_grid
from tiles.layout import tileable_prefix
from tiles.regions import TilingError
from tiles.stage_graph import stage_refusal
from tiles.whole_stage import InProcessStage


class TiledTrainer(LocalTrainer):
    def __init__(self, cfg: TrainConfig, cfg_text: str | None = None, state: dict | None = None, *,
                 grid: tuple[int, int], sync: str = "all", last: int | None = None, log=None):
        super().__init__(cfg, cfg_text, state)
        desc = self.desc
        self.last = tileable_prefix(desc) if last is None else last
        if self.last == 0:
            raise SwarmError(f"model {desc.name} starts with a {desc.layers[0].kind} layer, which cannot be tiled; "
                             "use --strategy local")
        refusal = stage_refusal(desc, 0, self.last) if 0 < self.last <= len(desc.layers) else \
            f"the model has layers 0-{len(desc.layers) - 1}"
        if refusal is not None:
            raise SwarmError(f"layers 0-{self.last - 1} of {desc.name} cannot be one tiles stage: {refusal}")
        try:
            grouping = Grouping.parse(sync, 0, self.last)
            self.stage = InProcessStage.build(self.net.layers[:self.last], desc.layers[:self.last], grid, grouping,
                                              input_delta=False)
        except TilingError as exc:
            raise SwarmError(f"{exc} (model {desc.name} at --img-size {desc.img_size.to_json()})") from None
        self.microbatch = 0
        if log is not None:
            rest = "" if self.last == len(desc.layers) else f"; layers {self.last}-{len(desc.layers) - 1} untiled"
            log(f"tiles: layers 0-{self.last - 1} on a {grid[0]}x{grid[1]} grid, run in this process; "
                f"{grouping.describe()}{rest}")

    def forward_backward(self, images: np.ndarray, targets: np.ndarray, keys: list[int], batch_total: int) -> float:
        mb, self.microbatch = self.microbatch, self.microbatch + 1
        n = len(self.desc.layers)
        x = torch.from_numpy(images).to(self.device, non_blocking=True)
        y = self.stage.forward(mb, x).requires_grad_(True)  # (B, C, H, W) stage output
        out = y if self.last == n else self.net.forward_range(self.last, n, {self.last - 1: y}, keys)[n - 1]
        loss = self.loss_fn(out, self.targets_for_loss(targets), batch_total)
        loss.backward()
        self.stage.backward(mb, y.grad)
        return float(loss.detach())


def tiled_trainer_factory(grid_text: str, sync: str | None, log=None):
    """make_trainer for swarm.local.trainer.train from the --grid and --sync flags."""
    try:
        grid = parse_grid(grid_text)
    except TilingError as exc:
        raise SwarmError(str(exc)) from None

    def make(cfg: TrainConfig, cfg_text: str | None, state: dict | None) -> TiledTrainer:
        return TiledTrainer(cfg, cfg_text, state, grid=grid, sync=sync or "all", log=log)
    return make
