"""The collective requests a tile's work yields to whoever drives it (no torch import).

A tile's forward or backward pass for one micro-batch is a generator (see
tiles.executor). Between pieces of local compute it yields one of these and waits for
the result to be sent back in:

    HaloExchange  at a sync boundary: `sends` are (to tile, rect, tensor) of this tile's
                  owned pixels; `receives` are (from tile, rect) it needs. Result: a list of
                  tensors, one per receive, in order, each shaped (B, C, rect rows, rect cols).
    ChannelSums   a per-channel BatchNorm reduction: `values` (G, 2, C) float64 from this
                  tile's owned pixels, one row per micro-batch of the block the tile runs.
                  Result: the element-wise sum of `values` over all tiles.

Every tile of a stage yields the same sequence of requests (same kind, phase, boundary or
layer, micro-batch), so a driver may run them in lockstep, and messages can be matched by
(microbatch, phase, key, src, dst). The rects match `StageLayout.forward_transfers` /
`backward_transfers`, so a receiver knows every message size in advance. Tensors in
`sends` may be views of larger tensors: copy or make them contiguous before putting
their bytes on a wire.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiles.regions import Rect


@dataclass
class HaloExchange:
    microbatch: int
    phase: str  # "forward" (activations), "backward" (gradients at the layer's window output) or
    #             "selection" (max-pool window choices, uint8, keyed by the pool's output boundary)
    boundary: int
    sends: list[tuple[int, Rect, Any]] = field(default_factory=list)  # (dst tile, rect, tensor (B, C, h, w))
    receives: list[tuple[int, Rect]] = field(default_factory=list)  # (src tile, rect)

    @property
    def key(self) -> tuple:
        return ("halo", self.microbatch, self.phase, self.boundary)


@dataclass
class ChannelSums:
    microbatch: int
    phase: str  # "forward": [sum x, sum x^2]; "backward": [sum g, sum g * xhat]
    layer: int
    values: Any  # (G, 2, C) float64

    @property
    def key(self) -> tuple:
        return ("sums", self.microbatch, self.phase, self.layer)
