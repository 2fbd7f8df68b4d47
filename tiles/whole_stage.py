"""A whole tiles stage in one process: cut the input into tile rectangles, run every tile in lockstep, stitch.

    stage = InProcessStage.build(net.layers[first:last], desc.layers[first:last], grid=(2, 2),
                                 grouping=Grouping.every_layer(first, last), input_delta=first > 0)
    y = stage.forward(mb, x)       # x (B, C, H, W) full stage input -> (B, C', H', W') full output
    dx = stage.backward(mb, dy)    # dy: dL/dy, full map -> dL/dx full map (None for a first stage)

Each tile sees only its own rectangles (the input rectangle, its owned output and output
delta); the full maps exist here only because the untiled rest of the network (and the
loss) needs them.
"""
from __future__ import annotations

import torch

from tiles.driver import run_lockstep
from tiles.executor import TileWorker
from tiles.grouping import Grouping
from tiles.layout import StageLayout, build_layout
from tiles.ops import crop
from tiles.regions import Rect
from tiles.stage_graph import stage_geometries


class InProcessStage:
    def __init__(self, layout: StageLayout, modules):
        self.layout = layout
        # one copy of the modules: tile 0 alone advances the BatchNorm running statistics
        self.workers = [TileWorker(layout, k, modules, keeps_running_stats=k == 0) for k in range(layout.n_tiles)]

    @classmethod
    def build(cls, modules, layer_descs, grid: tuple[int, int], grouping: Grouping, input_delta: bool,
              row_cuts=None, col_cuts=None) -> "InProcessStage":
        geoms = stage_geometries(list(layer_descs))
        return cls(build_layout(geoms, grid, grouping, input_delta, row_cuts, col_cuts), list(modules))

    def forward(self, mb: int, x: torch.Tensor, splits: tuple[int, ...] | None = None) -> torch.Tensor:
        lay = self.layout
        whole = Rect.of(0, x.shape[2], 0, x.shape[3])
        outs = run_lockstep([w.forward(mb, crop(x, whole, lay.input_rect(k)), splits)
                             for k, w in enumerate(self.workers)])
        c, h, w = lay.map_shape(lay.last)
        y = outs[0].new_empty((x.shape[0], c, h, w))  # (B, C', H', W')
        for k, part in enumerate(outs):
            rows, cols = lay.output_rect(k).relative_to(Rect.of(0, h, 0, w))
            y[:, :, rows, cols] = part
        return y

    def backward(self, mb: int, dy: torch.Tensor) -> torch.Tensor | None:
        lay = self.layout
        c, h, w = lay.map_shape(lay.last)
        whole = Rect.of(0, h, 0, w)
        dxs = run_lockstep([wk.backward(mb, crop(dy, whole, lay.output_rect(k))) for k, wk in enumerate(self.workers)])
        if not lay.input_delta:
            return None
        c0, h0, w0 = lay.map_shape(lay.first)
        dx = dy.new_empty((dy.shape[0], c0, h0, w0))
        for k, part in enumerate(dxs):
            rows, cols = lay.delta_out_rect(k).relative_to(Rect.of(0, h0, 0, w0))
            dx[:, :, rows, cols] = part
        return dx
