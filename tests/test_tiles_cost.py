"""The tiles cost model: bytes, redundant FLOPs and memory agree with the layout and the executor; grouping choice."""
from __future__ import annotations

import torch

from swarm.zoo import build_model, describe_model
from tiles.cost import choose_grouping, stage_cost
from tiles.driver import run_lockstep
from tiles.executor import TileWorker
from tiles.grouping import Grouping
from tiles.layout import build_layout
from tiles.ops import crop
from tiles.regions import LayerGeometry, Rect


def _layout(size, grid, grouping, n=17):
    desc = describe_model("yolov2-16", size)
    return build_layout([LayerGeometry.from_desc(d) for d in desc.layers[:n]], grid, grouping, input_delta=False)


def test_halo_bytes_follow_the_transfers():
    cost = stage_cost(_layout(416, (2, 2), Grouping.every_layer(0, 17)))
    t0 = cost.tiles[0]
    # a 3x3 conv on tile 0's 104x104 share of the 208x208, 32-channel map reads one more row and column
    assert t0.forward_recv[2] == (105 * 105 - 104 * 104) * 32 * 4
    assert t0.forward_recv[3] == 0 and t0.forward_recv[5] == 0  # aligned 2x2 max-pool, 1x1 conv: no halo
    assert sum(t.forward_send[2] for t in cost.tiles) == sum(t.forward_recv[2] for t in cost.tiles)
    assert t0.backward_recv[3] == (105 * 105 - 104 * 104) * 64 * 4  # layer 2's output gradient, before BN
    assert not cost.layout.selection_transfers  # every pool routed by its owner alone


def test_one_tile_has_no_halo_and_no_redundancy():
    cost = stage_cost(_layout(128, (1, 1), Grouping.one_group(0, 17)))
    assert cost.tiles[0].halo_bytes == 0
    assert abs(cost.redundant_flops) < 1e-6 * cost.untiled_flops


def test_bigger_groups_trade_redundant_compute_for_fewer_syncs():
    every = stage_cost(_layout(416, (4, 4), Grouping.every_layer(0, 17)))
    mixed = stage_cost(_layout(416, (4, 4), Grouping.parse("0,4,8,12", 0, 17)))
    one = stage_cost(_layout(416, (4, 4), Grouping.one_group(0, 17)))
    assert every.redundant_flops < mixed.redundant_flops < one.redundant_flops
    assert every.comm_time(1e9, latency_s=1e-3) > one.comm_time(1e9, latency_s=1e-3)
    assert every.max_peak_bytes < one.max_peak_bytes


def test_choose_grouping_follows_the_paper():
    layers = describe_model("yolov2-16", 416).layers
    pi = choose_grouping(layers, (4, 4), flops_per_s=1e9, bytes_per_s=12.5e6, latency_s=1e-3, samples=4)
    assert len(pi.grouping.forward) >= 12  # compute-bound Raspberry Pis: sync (almost) every layer
    gpu = choose_grouping(layers, (1, 2), flops_per_s=2e11, bytes_per_s=1.25e9, latency_s=5e-3, samples=1)
    assert len(gpu.grouping.forward) <= 3  # fast compute, costly synchronisation: few large groups
    for choice, speed in ((pi, (1e9, 12.5e6, 1e-3, 4)), (gpu, (2e11, 1.25e9, 5e-3, 1))):
        grid = choice.cost.layout.grid
        for other in (Grouping.every_layer(0, 17), Grouping.one_group(0, 17), Grouping.parse("0,4,8,12", 0, 17)):
            assert choice.time_s <= stage_cost(_layout(416, grid, other)).step_time(*speed) * 1.02


def test_saved_bytes_model_equals_what_the_executor_keeps():
    torch.set_num_threads(1)
    net, desc, _ = build_model("yolov2-16", 64, classes=5, seed=0)
    for grouping in (Grouping.every_layer(0, 17), Grouping.parse("0,3,9", 0, 17)):
        lay = build_layout([LayerGeometry.from_desc(d) for d in desc.layers], (2, 3), grouping, input_delta=False)
        workers = [TileWorker(lay, k, list(net.layers), keeps_running_stats=False) for k in range(lay.n_tiles)]
        x = torch.rand(2, 3, 64, 64)
        run_lockstep([w.forward(0, crop(x, Rect.of(0, 64, 0, 64), lay.input_rect(k))) for k, w in enumerate(workers)])
        cost = stage_cost(lay)
        stats = sum(g.out_channels * 4 for g in lay.layers if g.batch_norm)  # 1/std per BN layer
        for k, w in enumerate(workers):
            assert w.saved_bytes(0) == 2 * cost.tiles[k].saved_bytes + stats
