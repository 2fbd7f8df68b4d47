"""Halos across devices: the layouts of a plan's tiles stages (which rectangle each tile needs,
owns and returns) and the driver that runs one device's tiles, trading halo rectangles and
channel sums with the tiles on other devices over endpoints.

What a tile exchanges is decided in tiles/layout.py (the halo transfers), when it asks for
them in tiles/executor.py (the requests of tiles/requests.py), and what they cost the planner
in tiles/cost.py; the same exchange inside one process is tiles/driver.py."""
from __future__ import annotations

from planner.model_desc import ModelDesc
from planner.plan import Plan, PlanError
from swarm.execution import channels
from swarm.local.compute_device import to_host
from tiles.grouping import Grouping
from tiles.layout import StageLayout, build_layout
from tiles.regions import Rect, TilingError
from tiles.requests import ChannelSums
from tiles.stage_graph import stage_geometries


def stage_layout(plan: Plan, desc: ModelDesc, p: int) -> StageLayout:
    stage = plan.stages[p]
    try:
        geoms = stage_geometries(desc.layers[stage.first:stage.last])
        grouping = Grouping(stage.first, stage.last, tuple(stage.forward_syncs()), tuple(stage.backward_syncs()))
        return build_layout(geoms, tuple(stage.grid), grouping, input_delta=stage.first > 0)
    except TilingError as exc:
        raise PlanError(f"stage {p}: {exc}") from None


def spans(rect: Rect) -> tuple[tuple[int, int], tuple[int, int]]:
    return (rect.rows.lo, rect.rows.hi), (rect.cols.lo, rect.cols.hi)


class TileGeometry:
    """tile_regions(p) for routing.Layout: per tile of stage p, the input it needs, the output
    it owns, and the input gradient it returns."""

    def __init__(self, plan: Plan, desc: ModelDesc):
        self.plan = plan
        self.desc = desc
        self.layouts: dict[int, StageLayout] = {}
        self.regions: dict[int, tuple] = {}  # per instance: a cache on the method would keep every plan's

    def layout(self, p: int) -> StageLayout:
        if p not in self.layouts:
            self.layouts[p] = stage_layout(self.plan, self.desc, p)
        return self.layouts[p]

    def __call__(self, p: int):
        if p not in self.regions:
            lay = self.layout(p)
            n = lay.n_tiles
            needed = [spans(lay.input_rect(k)) for k in range(n)]
            owned = [spans(lay.output_rect(k)) for k in range(n)]
            returned = [spans(lay.delta_out_rect(k)) if lay.input_delta else ((0, 0), (0, 0)) for k in range(n)]
            self.regions[p] = needed, owned, returned
        return self.regions[p]


class DeviceTiles:
    """Steps the generators of the tiles one device owns of one stage, answering their
    requests: halos from and to tiles on other devices, BatchNorm sums over the group.

    The local tiles' sums are added in tile order, then the devices' partial sums in the
    stage's device order (the same on every device)."""

    def __init__(self, worker, step: int, p: int, tile_devices: list[str]):
        self.w = worker
        self.step = step
        self.p = p
        self.tile_devices = tile_devices
        self.group = list(dict.fromkeys(tile_devices))

    async def run(self, gens: dict[int, object]) -> dict[int, object]:
        from swarm.execution.collectives import allgather

        w, me = self.w, self.w.device
        results: dict[int, object] = {}
        answers = {k: None for k in gens}
        live = sorted(gens)
        while live:
            requests = {}
            for k in live:
                kind, value = await w.compute(_advance, gens[k], answers[k])
                if kind == "done":
                    results[k] = value
                else:
                    requests[k] = value
            if not requests:
                break
            if len(requests) != len(live):
                raise TilingError(f"tiles {sorted(set(live) - set(requests))} finished before the others")
            keys = {r.key for r in requests.values()}
            if len(keys) != 1:
                raise TilingError(f"tiles are out of step: {sorted(map(str, keys))}")
            key = keys.pop()
            live = sorted(requests)
            if isinstance(requests[live[0]], ChannelSums):
                local = requests[live[0]].values.clone()
                for k in live[1:]:
                    local += requests[k].values
                if len(self.group) > 1:
                    where = local.device
                    parts = await allgather(w.ep, self.group, channels.tile_sums(self.step, self.p, key),
                                            [to_host(local)], w.job.timeout_s)
                    local = parts[0][0].clone()
                    for part in parts[1:]:
                        local += part[0]
                    local = local.to(where)
                answers = {k: local for k in live}
                continue
            mail = {}
            for k in live:
                for dst, rect, tensor in requests[k].sends:
                    where = self.tile_devices[dst]
                    if where == me:
                        mail[(k, dst, rect)] = tensor
                    else:
                        await w.ep.send(where, channels.halo(self.step, self.p, key, k, dst, _coords(rect)),
                                        {"arrays": [to_host(tensor.contiguous())]})
            answers = {}
            for k in live:
                got = []
                for src, rect in requests[k].receives:
                    if self.tile_devices[src] == me:
                        got.append(mail.pop((src, k, rect)))
                    else:
                        msg = await w.ep.mailbox.get(channels.halo(self.step, self.p, key, src, k, _coords(rect)),
                                                     w.job.timeout_s)
                        got.append(msg["arrays"][0].to(w.compute_on, non_blocking=True))
                answers[k] = got
        return results


def _coords(rect: Rect) -> tuple[int, int, int, int]:
    return rect.rows.lo, rect.rows.hi, rect.cols.lo, rect.cols.hi


def _advance(gen, answer):
    """Run a tile until its next request (in a compute thread)."""
    try:
        return "request", gen.send(answer)
    except StopIteration as stop:
        return "done", stop.value
