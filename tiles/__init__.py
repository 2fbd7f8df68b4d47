"""tiles: spatial tiling of conv/pool/BN layers: regions, halos, fused tile stacks (imports torch, numpy; never swarm, trio or planner).

Exact fused tiled training, forward and backward, with layer grouping (Rama et al.), over
chains of windows and over the residual and CSP blocks of graph networks.

Pure modules (no torch; the planner imports them):
    tiles.regions      Span, Rect, AxisWindow, LayerGeometry: what a window layer reads and touches;
                       LayerSpec: what tiling reads of a layer's description (tiles import no planner)
    tiles.grouping     Grouping (forward/backward sync boundaries), parse_grid
    tiles.stage_graph  which layers one stage can take (stage_refusal, tileable_ends), where it must sync
                       (required_syncs), each layer's geometry with its inputs' shapes (stage_geometries)
    tiles.layout       build_layout -> StageLayout: every tile's regions and halo transfers; tileable_prefix
    tiles.cost         stage_cost, choose_grouping: bytes, redundant FLOPs, memory, time
    tiles.requests     HaloExchange, ChannelSums: what a tile's work yields to its driver
    tiles.driver       run_lockstep: all tiles of a stage in one process
Torch modules:
    tiles.executor     TileWorker: one tile's forward/backward generators
    tiles.whole_stage  InProcessStage: cut, run in lockstep, stitch
    tiles.ops          the per-region arithmetic (window ops, BatchNorm from global sums)

Only the pure names are re-exported here, so `import tiles` never imports torch.
"""
from tiles.cost import GroupingChoice, StageCost, TileCost, choose_grouping, stage_cost
from tiles.driver import run_lockstep
from tiles.grouping import Grouping, parse_grid
from tiles.layout import StageLayout, TileRegions, Transfer, build_layout, tileable_prefix
from tiles.regions import LayerGeometry, Padding, Rect, Span, TilingError
from tiles.requests import ChannelSums, HaloExchange

__all__ = [
    "ChannelSums", "Grouping", "GroupingChoice", "HaloExchange", "LayerGeometry", "Padding", "Rect", "Span",
    "StageCost", "StageLayout", "TileCost", "TileRegions", "TilingError", "Transfer", "build_layout",
    "choose_grouping", "parse_grid", "run_lockstep", "stage_cost", "tileable_prefix",
]
