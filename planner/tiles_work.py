"""A tiles stage's work per device, from the tiles cost model (tiles/cost.py) and each
device's measured layer times.

Tile k of the grid runs on tile_devices[k]; a device may hold several tiles. A tile's time
on a layer is the device's time for the whole layer at the same number of samples, scaled
by the tile's share of that layer's FLOPs (halo recomputation included) and by the device's
tiles overhead (the executor's time over autograd's for the same work, profiled). Tiles move in
lockstep layer by layer (BatchNorm sums make each conv+BN a barrier), so a micro-batch
takes, per layer, the slowest device's time for its tiles, plus at every sync the latency,
the time per message for the most halo regions a device sends and receives, and the
largest halo any device sends or receives (tiles on one device swap nothing), plus two
BatchNorm gathers per BN layer. A stage over residual or CSP blocks counts its shortcuts
and routes like its other layers (each tile's share is its owned pixels; they trade no
halos). Every device keeps all the stage's weights; their
per-tile partial gradients are all-reduced once per mini-batch.
"""
from __future__ import annotations

from dataclasses import replace

from planner.cluster import Cluster
from planner.memory import MemoryModel
from planner.model_desc import ModelDesc
from planner.plan import Plan, PlanError, Stage
from planner.stage_work import Share, StageWork, allgather_time, gradient_buckets, ring_allreduce_time
from tiles.cost import StageCost, stage_cost
from tiles.grouping import Grouping
from tiles.layout import build_layout
from tiles.regions import TilingError
from tiles.stage_graph import stage_geometries


_COSTS: dict = {}  # (id(desc), first, last, grid, syncs, back_syncs) -> (desc, StageCost)


def _stage_cost(desc: ModelDesc, first: int, last: int, grid: tuple[int, int], forward: tuple[int, ...],
                backward: tuple[int, ...]) -> StageCost:
    key = (id(desc), first, last, grid, forward, backward)
    if key in _COSTS and _COSTS[key][0] is desc:
        return _COSTS[key][1]
    if len(_COSTS) > 512:
        _COSTS.clear()
    try:
        geoms = stage_geometries(desc.layers[first:last])
        layout = build_layout(geoms, grid, Grouping(first, last, forward, backward), first > 0)
    except TilingError as exc:
        raise PlanError(f"tiles stage (layers {first}-{last - 1}): {exc}") from None
    _COSTS[key] = (desc, stage_cost(layout))
    return _COSTS[key][1]


def tiles_cost(desc: ModelDesc, stage: Stage) -> StageCost:
    """The tiles cost model's StageCost of a plan's tiles stage."""
    return _stage_cost(desc, stage.first, stage.last, tuple(stage.grid), tuple(stage.forward_syncs()),
                       tuple(stage.backward_syncs()))


_WORKS: dict = {}  # the same tiles stage simulated again (candidate plans share their front)


def tiles_stage_work(p: int, stage: Stage, plan: Plan, desc: ModelDesc, mem: MemoryModel, cluster: Cluster,
                     sizes: list[int], is_last: bool) -> StageWork:
    key = (id(desc), id(mem), id(cluster), stage.first, stage.last, tuple(stage.grid), tuple(stage.tile_devices),
           tuple(stage.forward_syncs()), tuple(stage.backward_syncs()), tuple(sizes), is_last)
    hit = _WORKS.get(key)
    if hit is not None and hit[0] == (desc, mem, cluster):
        return replace(hit[1], index=p, stage=stage)
    if len(_WORKS) > 256:
        _WORKS.clear()
    work = _tiles_stage_work(p, stage, desc, mem, cluster, sizes, is_last)
    _WORKS[key] = ((desc, mem, cluster), work)
    return work


def tiles_compute(desc: ModelDesc, stage: Stage, cluster: Cluster, cost: StageCost, size: int) -> tuple[float, float]:
    """A micro-batch's forward and backward through the stage's layers in lock-step, without
    syncs or the loss: per layer, the slowest device's time for its tiles."""
    first, last = stage.first, stage.last
    tiles_of = {d: [k for k, o in enumerate(stage.tile_devices) if o == d] for d in stage.devices}
    f_total = b_total = 0.0
    for i, layer in enumerate(desc.layers[first:last]):
        l = layer.index
        needs_dx = first > 0 or i > 0
        untiled_bwd = layer.flops * ((1 if needs_dx else 0) + (1 if layer.params else 0))
        slow_f = slow_b = 0.0
        for d in stage.devices:
            costs = cluster.device(d).costs
            tf = costs.fwd_range(l, l + 1, size) * costs.tiles_overhead
            tb = costs.bwd_range(l, l + 1, size) * costs.tiles_overhead
            mine_f = sum(cost.tiles[k].layer_forward_flops[l] for k in tiles_of[d])
            mine_b = sum(cost.tiles[k].layer_backward_flops[l] for k in tiles_of[d])
            slow_f = max(slow_f, tf * mine_f / layer.flops if layer.flops else 0.0)
            slow_b = max(slow_b, tb * mine_b / untiled_bwd if untiled_bwd else 0.0)
        f_total += slow_f
        b_total += slow_b
    return f_total, b_total


def tiles_bn_time(cost: StageCost, devices: list[str], cluster: Cluster) -> float:
    """A micro-batch's BatchNorm exchanges through the stage (two gathers per BN layer)."""
    if len(devices) < 2:
        return 0.0
    return sum(2 * allgather_time(8 + 16 * c, devices, cluster) for c in cost.bn_channels)


def tiles_allreduce_time(stage: Stage, mem: MemoryModel, cluster: Cluster) -> float:
    """The stage's per-tile partial gradients summed over its devices, once a step."""
    if len(stage.devices) < 2:
        return 0.0
    return ring_allreduce_time(float(mem.param_bytes[stage.first:stage.last].sum()), stage.devices, cluster,
                               gradient_buckets(mem, stage.first, stage.last))


def _tiles_stage_work(p: int, stage: Stage, desc: ModelDesc, mem: MemoryModel, cluster: Cluster,
                      sizes: list[int], is_last: bool) -> StageWork:
    first, last = stage.first, stage.last
    cost = tiles_cost(desc, stage)
    lay = cost.layout
    devices = list(stage.devices)
    owner = list(stage.tile_devices)
    tiles_of = {d: [k for k, o in enumerate(owner) if o == d] for d in devices}
    area_in = lay.map_shape(first)[1] * lay.map_shape(first)[2]
    area_out = lay.map_shape(last)[1] * lay.map_shape(last)[2]
    frac_in = {d: min(1.0, sum(lay.input_rect(k).area for k in ks) / area_in) for d, ks in tiles_of.items()}
    frac_out = {d: sum(lay.output_rect(k).area for k in ks) / area_out for d, ks in tiles_of.items()}

    g = len(devices)
    minbw = cluster.min_bw(devices) if g > 1 else float("inf")
    cpu = cluster.comm_cpu(devices)
    msg = cluster.msg_cpu(devices)

    def sync_time(table: dict, samples: int) -> float:
        total = 0.0
        for b, transfers in table.items():
            ch = lay.map_shape(b)[0]
            sent = {d: 0.0 for d in devices}
            recv = {d: 0.0 for d in devices}
            count = {d: 0 for d in devices}
            for tr in transfers:
                a, z = owner[tr.src], owner[tr.dst]
                if a != z:
                    nbytes = tr.rect.area * ch * 4 * samples
                    sent[a] += nbytes
                    recv[z] += nbytes
                    count[a] += 1
                    count[z] += 1
            worst = max(max(sent.values()), max(recv.values()))
            moved = max(sent[d] + recv[d] for d in devices)
            messages = max(count.values())  # a message per halo region, handled at both ends
            # halos leave and reach an accelerator through the host: one copy each way per device
            copies = max(cluster.device(d).copy_time(sent[d] + recv[d]) for d in devices)
            if worst > 0:
                total += cluster.latency + messages * msg + max(worst / minbw, moved * cpu) + copies
        return total

    bn = tiles_bn_time(cost, devices, cluster)
    shares, fwd, bwd, act, trans = [], [], [], [], []
    for size in sizes:
        f_total, b_total = tiles_compute(desc, stage, cluster, cost, size)
        if is_last:  # the loss over each tile's block of the output
            f_total += max(cluster.device(d).costs.loss_time(size)[0] * frac_out[d] for d in devices)
            b_total += max(cluster.device(d).costs.loss_time(size)[1] * frac_out[d] for d in devices)
        halo_f = sync_time(lay.forward_transfers, size)
        halo_b = sync_time(lay.backward_transfers, size)
        shares.append([Share(d, 0, size, frac_in[d], frac_out[d]) for d in devices])
        fwd.append({d: f_total + halo_f + bn / 2 for d in devices})
        bwd.append({d: b_total + halo_b + bn / 2 for d in devices})
        # the tiles cost model counts tensors; a device holds them with the allocator's slack
        act.append({d: size * (mem.slack * sum(cost.tiles[k].saved_bytes for k in tiles_of[d])) for d in devices})
        trans.append({d: size * (mem.slack * max(cost.tiles[k].peak_bytes - cost.tiles[k].saved_bytes
                                                 for k in tiles_of[d])) for d in devices})
    weights = {d: mem.weights(first, last) for d in devices}
    allreduce = tiles_allreduce_time(stage, mem, cluster)
    update = {d: cluster.device(d).costs.update_range(first, last) for d in devices}
    halo_f = sync_time(lay.forward_transfers, sizes[0])
    halo_b = sync_time(lay.backward_transfers, sizes[0])
    detail = {"grid": list(stage.grid), "syncs": list(stage.forward_syncs()), "back_syncs": list(stage.backward_syncs()),
              "halo_bytes_per_sample": [t.halo_bytes for t in cost.tiles],
              "redundant_flops_per_sample": cost.redundant_flops}
    return StageWork(p, stage, True, shares, fwd, bwd, act, trans, weights, allreduce, update,
                     sync_fwd=halo_f + bn / 2, sync_bwd=halo_b + bn / 2, detail=detail)
