"""The Plan: which layers run where, split how — plain, versioned, JSON-serialisable data.

Every planner produces one, the simulator turns one into a timeline, and the workers
execute one. Layer boundaries are numbered like the layers: boundary b is the map that
enters layer b (the output of layer b - 1); boundary 0 is the image.

    {"version": 1, "model": "yolov2-16", "img_size": 416, "batch_size": 8, "microbatches": 4,   # or "608x352"
     "devices": {"pi-1": {}, "pi-2": {}},
     "stages": [
        {"first": 0, "last": 12, "mode": "tiles", "devices": ["pi-1", "pi-2"], "grid": [1, 2],
         "tile_devices": ["pi-1", "pi-2"], "syncs": [0, 4, 8], "back_syncs": [4, 8, 12]},
        {"first": 12, "last": 17, "mode": "single", "devices": ["pi-2"]}],
     "backups": {"0": "pi-2", "1": "pi-1"}}
"""
from __future__ import annotations

import json
from dataclasses import replace, asdict, dataclass, field

from planner.buckets import buckets_of
from planner.image_size import ImageSize
from planner.model_desc import ModelDesc
from planner.schedule import asteroid_warmup, check_warmups
from tiles.stage_graph import missing_syncs, stage_refusal

PLAN_VERSION = 1
MODES = ("single", "dp", "tiles")


class PlanError(ValueError):
    """A plan that cannot run; the message says which stage and why."""


def most_replicas(microbatches: int, devices: int) -> int:
    """How many copies of a one-stage plan `devices` devices can run, each taking an equal
    share of whole micro-batches: the largest divisor of `microbatches` not above `devices`."""
    return max(r for r in range(1, min(devices, microbatches) + 1) if microbatches % r == 0)


@dataclass
class Stage:
    """Layers [first, last) run by a group of devices in one mode.

    single: devices has one entry.
    dp:     each micro-batch is split by `allocation` {device: samples}, dealt in the order
            of `devices` (the first device takes the first samples); gradients (and
            BatchNorm sums) are reduced inside the group.
    tiles:  each map is split into a grid (rows, cols); tile k (row-major) runs on
            tile_devices[k]. Forward, tiles exchange activation halos at the boundaries in
            `syncs` (always including `first`); backward, delta halos at `back_syncs`
            (always including `last`). Default: a sync at every layer. The layers may
            hold residual and CSP blocks (tiles.stage_graph: what one stage can take); the
            syncs then include every boundary next to a shortcut or route or at a map read
            twice, both ways.
    warmup: K_p, forwards before the first backward (default Asteroid's 2(P - p) - 1).
    together: (tiles, in a one-stage plan) micro-batches run through the stage as one block:
            one halo and one BatchNorm exchange per sync for all of them, larger and faster
            kernels, the gradient sum overlapped with the whole backward; each micro-batch
            keeps its own BatchNorm statistics, so the result does not change. Costs the
            activation memory of the block. Divides the micro-batches; default 1.
    replicas: copies of the stage that run different micro-batches at once (a tiles stage
            only in a one-stage plan). single: `devices` lists one device per replica. tiles:
            tile_devices lists replica 0's tiles, then replica 1's, and so on (no device in two
            replicas). dp: `devices` lists replica 0's group, then replica 1's (see groups).
            Replica r runs the r-th run of microbatches / replicas consecutive micro-batches (a
            tiles replica `together` of them at a time); halos and BatchNorm sums stay inside a
            replica, and in a pipeline a micro-batch goes from the replica of one stage that
            runs it to the replica of the next that runs it. The weight gradients are summed
            over all the devices and the BatchNorm running statistics are brought to what the
            micro-batches give in order, so the result does not change. A replicated pipeline
            stage sums its gradients where a BatchNorm group would exchange sums at every
            layer of every micro-batch. Default 1.
    shares: (replicas of a single or dp stage) how many micro-batches each replica runs,
            replica 0 the first shares[0] of them and so on: faster devices take more, so that
            uneven devices finish together. Default: equal shares (replicas divides the
            micro-batches).
    groups: (replicas of a dp stage) how many of `devices` each replica takes, in order:
            replica r is a dp group of groups[r] devices that splits each of its micro-batches
            by `allocation`, its BatchNorm sums staying inside the group. Groups of uneven
            devices with uneven shares keep every device of a mixed swarm busy when no device
            alone can hold a micro-batch. Default: equal groups.
    overlap: (dp) each backward runs beside the forward that follows it in the schedule:
            while one waits for its group's BatchNorm sums, the other computes. Backwards
            still run in order, and forwards, so the result does not change. Costs one more
            micro-batch of activations during each backward. Default off.
    recompute: (single, dp) the backward remakes each BatchNorm output and activation result from
            the conv's output instead of keeping them (swarm.zoo.recompute): a layer keeps one
            map of its output's size, not two or three, for one more pass over it in the
            backward. The gradients are the same, bit for bit. Default off.
    deal: (replicas of a single or dp stage) "runs" (the default): replica r takes the r-th run of
            consecutive micro-batches; "turns": the replicas take them in turn, each micro-batch
            going to the replica furthest behind its share (with equal shares, m to m mod R). In
            a pipeline, turns end the drain with one backward on each replica, not a run of them;
            the running statistics are then combined micro-batch by micro-batch.
    checkpoint: (single, and dp whose groups are one device each) the stage runs in the model's
            checkpointed segments (planner.checkpoint): a micro-batch keeps only the maps that
            cross a segment's start, and the backward runs each segment's forward again before
            back-propagating through it, one segment's maps at a time. The gradients are the
            same, bit for bit. Not with recompute (a remade segment keeps everything while it
            is remade). Default off.
    sum_order: (single, dp) the order in which the group's gradient-sum lanes sum the stage's
            buckets (planner.buckets.buckets_of, each named by its top layer): the cost model
            puts first what the next step's forward needs first where the backward allows
            (best_sum_order). A bucket's sum gives the same bits whenever it runs, so the result
            does not change. Default: top layer first, the order the backward makes them final.
    """

    first: int
    last: int
    mode: str = "single"
    devices: list[str] = field(default_factory=list)
    allocation: dict[str, int] | None = None
    grid: tuple[int, int] | None = None
    tile_devices: list[str] | None = None
    syncs: list[int] | None = None
    back_syncs: list[int] | None = None
    warmup: int | None = None
    together: int | None = None
    replicas: int | None = None
    shares: list[int] | None = None
    groups: list[int] | None = None
    overlap: bool | None = None
    recompute: bool | None = None
    checkpoint: bool | None = None
    deal: str | None = None
    sum_order: list[int] | None = None

    @property
    def layers(self) -> range:
        return range(self.first, self.last)

    def block(self) -> int:
        return self.together or 1

    def replica_count(self) -> int:
        return self.replicas or 1

    def tiles_per_replica(self) -> int:
        return len(self.tile_devices or []) // self.replica_count()

    def replica_shares(self, microbatches: int) -> list[int]:
        """How many micro-batches each replica runs (consecutive runs, replica 0's first)."""
        if self.shares:
            return list(self.shares)
        return [microbatches // self.replica_count()] * self.replica_count()

    def replica_order(self, microbatches: int) -> list[int]:
        """The replica of each micro-batch: consecutive runs of each replica's share (replica 0
        the first), or with `deal` "turns", the replicas in turn, each micro-batch to the one
        furthest behind its share, the first on a tie (with equal shares, m to m mod R)."""
        shares = self.replica_shares(microbatches)
        if self.deal != "turns":
            return [r for r, share in enumerate(shares) for _ in range(share)]
        taken, order = [0] * len(shares), []
        for _ in range(microbatches):
            r = min((r for r in range(len(shares)) if taken[r] < shares[r]), key=lambda r: (taken[r] / shares[r], r))
            taken[r] += 1
            order.append(r)
        return order

    def group_sizes(self) -> list[int]:
        """How many of `devices` each replica of a dp stage takes (one group: all of them)."""
        if self.groups:
            return list(self.groups)
        copies = self.replica_count()
        return [len(self.devices) // copies] * copies

    def sum_weights(self, microbatches: int) -> dict[str, int] | None:
        """How much of the stage's gradient sum each device owns (swarm.execution.collectives.
        chunk_bounds): the samples it computes a step, so that a device that computes little sums
        little. None where every device owns as much (and for tiles)."""
        if self.mode == "tiles":
            return None
        shares = self.replica_shares(microbatches)
        weights: dict[str, int] = {}
        for r in range(self.replica_count()):
            for d in self.replica_devices(r):
                per_mb = (self.allocation or {}).get(d, 1) if self.mode == "dp" else 1
                weights[d] = weights.get(d, 0) + per_mb * shares[r]
        return weights if len(set(weights.values())) > 1 else None

    def replica_devices(self, r: int) -> list[str]:
        """The devices of replica r (of a one-stage replicated plan; the stage's devices otherwise)."""
        if self.replica_count() == 1:
            return list(self.devices)
        if self.mode == "tiles":
            return list(dict.fromkeys(self.replica_tiles(r)))
        if self.mode == "dp":
            sizes = self.group_sizes()
            start = sum(sizes[:r])
            return list(self.devices[start:start + sizes[r]])
        return [self.devices[r]]

    def replica_tiles(self, r: int) -> list[str]:
        """Devices of replica r's tiles, in tile order."""
        n = self.tiles_per_replica()
        return list((self.tile_devices or [])[r * n:(r + 1) * n])

    def replica_of_part(self, part: int) -> int:
        """The replica of part `part` (routing.stage_parts numbers them)."""
        if self.replica_count() == 1:
            return 0
        if self.mode == "tiles":
            return part // self.tiles_per_replica()
        if self.mode == "dp":
            end = 0
            for r, size in enumerate(self.group_sizes()):
                end += size
                if part < end:
                    return r
            raise ValueError(f"part {part} is beyond the stage's {len(self.devices)} devices")
        return part

    def forward_syncs(self) -> list[int]:
        return sorted(set(self.syncs)) if self.syncs is not None else list(range(self.first, self.last))

    def backward_syncs(self) -> list[int]:
        if self.back_syncs is not None:
            return sorted(set(self.back_syncs))
        if self.syncs is not None:  # mirror the forward groups: each group's end
            return sorted(set(s for s in self.forward_syncs()[1:]) | {self.last})
        return list(range(self.first + 1, self.last + 1))


@dataclass
class Plan:
    model: str
    img_size: ImageSize  # width x height
    batch_size: int
    microbatches: int
    stages: list[Stage]
    devices: dict[str, dict] = field(default_factory=dict)  # name -> facts (cores, memory, ...)
    backups: dict[int, str] = field(default_factory=dict)  # stage index -> device keeping a copy
    predicted: dict | None = None  # {"step_time_s": float, "peak_memory": {device: bytes}, ...}
    planner: str = "manual"
    # every device serves its largest blocks from mappings of their own, not its heap
    # (planner.mapping: less memory, more compute; devices on glibc)
    mapped: bool = False
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        self.img_size = ImageSize.of(self.img_size)  # an int is a square

    # ---- derived facts -------------------------------------------------------------
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    def replica_of(self, m: int, p: int = 0) -> int:
        """The replica of stage p that runs micro-batch m (0 where the stage has one)."""
        if not self.stages[p].replicas:
            return 0
        if not 0 <= m < self.microbatches:
            raise ValueError(f"micro-batch {m} is beyond the plan's {self.microbatches}")
        return self.stages[p].replica_order(self.microbatches)[m]

    def replica_plan(self, r: int) -> "Plan":
        """Replica r of a one-stage replicated plan on its own: its devices running its share of
        the micro-batches (of the same size)."""
        s = self.stages[0]
        share = s.replica_shares(self.microbatches)[r]
        if s.mode == "tiles":
            tiles = s.replica_tiles(r)
            s = replace(s, devices=list(dict.fromkeys(tiles)), tile_devices=tiles, replicas=None, shares=None)
        elif s.mode == "dp":
            group = s.replica_devices(r)
            s = replace(s, devices=group, allocation={d: s.allocation[d] for d in group}, replicas=None, shares=None,
                        groups=None)
        else:
            s = replace(s, devices=[s.devices[r]], replicas=None, shares=None)
        return replace(self, batch_size=self.microbatch_size() * share, microbatches=share, stages=[s],
                       devices={d: f for d, f in self.devices.items() if d in s.devices})

    def in_blocks(self) -> "Plan":
        """The plan as its stages see the work: a one-stage plan that runs `together`
        micro-batches as one block takes the time and memory of the plan with M / together
        micro-batches of that many times the samples (the statistics are per micro-batch, the
        cost is not). A replicated plan: see replica_plan."""
        if len(self.stages) != 1 or self.stages[0].block() == 1:
            return self
        s, size = self.stages[0], self.stages[0].block()
        return replace(self, batch_size=self.batch_size, microbatches=self.microbatches // size,
                       stages=[replace(s, together=None)])

    def warmups(self) -> list[int]:
        p = len(self.stages)
        return [s.warmup if s.warmup is not None else asteroid_warmup(p, i) for i, s in enumerate(self.stages)]

    def stage_of_layer(self, layer: int) -> int:
        for i, s in enumerate(self.stages):
            if s.first <= layer < s.last:
                return i
        raise PlanError(f"layer {layer} is in no stage")

    def stages_of_device(self, device: str) -> list[int]:
        return [i for i, s in enumerate(self.stages) if device in s.devices]

    def used_devices(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.stages:
            for d in s.devices:
                seen.setdefault(d, None)
        return list(seen)

    # ---- checking ------------------------------------------------------------------
    def describe(self) -> str:
        """The plan as `swarm train` prints it: one line for the whole, one for each stage."""
        lines = [f"plan ({self.planner}): {len(self.stages)} stage(s), {len(self.used_devices())} device(s), "
                 f"batch {self.batch_size} in {self.microbatches} micro-batch(es)"
                 + (", largest blocks mapped afresh" if self.mapped else "")]
        for i, s in enumerate(self.stages):
            how = s.mode
            if s.mode == "tiles":
                how += f" {s.grid[0]}x{s.grid[1]}"
                if s.block() > 1:
                    how += f", {s.block()} micro-batches at a time"
            elif s.mode == "dp":
                how += " " + " | ".join(",".join(f"{d}:{s.allocation[d]}" for d in s.replica_devices(r))
                                        for r in range(s.replica_count()))
            if s.shares:
                taking = (",".join(str(k) for k in s.shares) if s.mode == "dp"
                          else ",".join(f"{d}:{k}" for d, k in zip(s.devices, s.shares)))
                how += f", {s.replica_count()} replicas taking {taking} micro-batches"
            elif s.replica_count() > 1:
                how += f", {s.replica_count()} replicas of {self.microbatches // s.replica_count()} micro-batch(es) each"
            if s.deal == "turns" and s.replica_count() > 1:
                how += ", in turns"
            if s.overlap:
                how += ", each backward beside the next forward"
            if s.recompute:
                how += ", BatchNorm remade in the backward"
            if s.checkpoint:
                how += ", in checkpointed segments"
            if s.sum_order:
                how += f", gradients summed in the order {','.join(map(str, s.sum_order))} (buckets by top layer)"
            on = ", ".join(f"{d} ({self.devices[d]['accelerator']})" if (self.devices.get(d) or {}).get("accelerator")
                           else d for d in s.devices)
            lines.append(f"  stage {i}: layers {s.first}-{s.last - 1} {how} on {on}")
        return "\n".join(lines)

    def checkpoints(self) -> bool:
        """Whether the plan's stages run in checkpointed segments (Stage.checkpoint)."""
        return any(s.checkpoint for s in self.stages)

    def recomputes(self) -> bool:
        """Whether the plan's stages remake BatchNorm in the backward (Stage.recompute)."""
        return any(s.recompute for s in self.stages)

    def validate(self, desc: ModelDesc | None = None) -> None:
        """Raise PlanError unless the plan can run (against the model when given)."""
        if self.version != PLAN_VERSION:
            raise PlanError(f"plan version {self.version} is not supported (this swarm reads version {PLAN_VERSION})")
        if self.batch_size < 1 or not 1 <= self.microbatches <= self.batch_size:
            raise PlanError(f"batch size {self.batch_size} with {self.microbatches} micro-batches is impossible")
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        if self.mapped and (self.recomputes() or self.checkpoints()):
            raise PlanError("a plan that maps its largest blocks keeps every map: no recompute or checkpoint")
        n_layers = len(desc.layers) if desc is not None else self.stages[-1].last
        if desc is not None and (desc.img_size != self.img_size):
            raise PlanError(f"the plan is for {self.img_size} images, the model is built for {desc.img_size}")
        expect = 0
        for i, s in enumerate(self.stages):
            where = f"stage {i} (layers {s.first}-{s.last - 1})"
            if s.first != expect:
                what = "repeats" if s.first < expect else "skips"
                raise PlanError(f"{where} {what} layers: it should start at layer {expect}")
            if s.last <= s.first:
                raise PlanError(f"stage {i} is empty (first {s.first}, last {s.last})")
            expect = s.last
            if s.mode not in MODES:
                raise PlanError(f"{where}: mode '{s.mode}' is not one of {', '.join(MODES)}")
            if not s.devices:
                raise PlanError(f"{where} has no devices")
            if len(set(s.devices)) != len(s.devices):
                raise PlanError(f"{where} lists a device twice")
            if self.devices:
                unknown = [d for d in s.devices if d not in self.devices]
                if unknown:
                    raise PlanError(f"{where} uses unknown device(s) {', '.join(unknown)}; known: {', '.join(self.devices)}")
            if s.shares is not None and s.replicas in (None, 1):
                raise PlanError(f"{where}: shares are for a stage with replicas")
            if s.groups is not None and (s.mode != "dp" or s.replicas in (None, 1)):
                raise PlanError(f"{where}: groups are for the replicas of a dp stage")
            if s.together not in (None, 1) and s.mode != "tiles":
                raise PlanError(f"{where}: only a tiles stage runs micro-batches together")
            if s.overlap not in (None, False, True):
                raise PlanError(f"{where}: overlap is true or false, not {s.overlap!r}")
            if s.overlap and s.mode != "dp":
                raise PlanError(f"{where}: only a dp stage overlaps a backward with the next forward")
            if s.recompute not in (None, False, True):
                raise PlanError(f"{where}: recompute is true or false, not {s.recompute!r}")
            if s.recompute and s.mode == "tiles":
                raise PlanError(f"{where}: a tiles stage keeps its own maps; recompute is for single and dp stages")
            if s.checkpoint not in (None, False, True):
                raise PlanError(f"{where}: checkpoint is true or false, not {s.checkpoint!r}")
            if s.checkpoint and (s.mode == "tiles" or (s.mode == "dp" and max(s.group_sizes()) > 1)):
                raise PlanError(f"{where}: a checkpointed stage runs whole micro-batches on each device (single, or "
                                f"dp replicas of one device each); its BatchNorm cannot gather a group's sums again "
                                f"in the backward")
            if s.checkpoint and s.recompute:
                raise PlanError(f"{where}: checkpoint and recompute are one or the other")
            if s.replicas not in (None, 1):
                if len(self.stages) > 1 and s.mode == "tiles":
                    raise PlanError(f"{where}: replicas={s.replicas} of a tiles stage only in a plan with this one stage")
                if s.shares is not None:
                    if s.mode == "tiles":
                        raise PlanError(f"{where}: only replicas of a single or dp stage take shares")
                    if len(s.shares) != s.replicas or min(s.shares) < 1 or sum(s.shares) != self.microbatches:
                        raise PlanError(f"{where}: shares {s.shares} must give each of the {s.replicas} replicas at "
                                        f"least one micro-batch, {self.microbatches} in all")
                elif s.replicas < 1 or self.microbatches % s.replicas:
                    raise PlanError(f"{where}: replicas={s.replicas} must divide the {self.microbatches} micro-batches")
            if s.deal not in (None, "runs", "turns"):
                raise PlanError(f"{where}: deal is 'runs' or 'turns', not {s.deal!r}")
            if s.deal == "turns" and (s.replicas in (None, 1) or s.mode == "tiles"):
                raise PlanError(f"{where}: micro-batches are dealt in turns only to the replicas of a single or dp stage")
            if s.sum_order is not None:
                self._check_sum_order(s, where, desc)
            getattr(self, f"_check_{s.mode}")(i, s, where, desc)
        if expect != n_layers:
            raise PlanError(f"the stages end at layer {expect - 1}, but the model has {n_layers} layers (0-{n_layers - 1})")
        try:
            check_warmups(self.warmups(), self.microbatches)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        for idx, dev in self.backups.items():
            if not 0 <= int(idx) < len(self.stages):
                raise PlanError(f"backup for stage {idx}, which does not exist")
            if self.devices and dev not in self.devices:
                raise PlanError(f"backup of stage {idx} on unknown device {dev}")

    @staticmethod
    def _check_sum_order(s: Stage, where: str, desc) -> None:
        order = s.sum_order
        if s.mode == "tiles":
            raise PlanError(f"{where}: sum_order is for single and dp stages (a tiles stage ends every step settled)")
        if (not isinstance(order, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in order)
                or len(set(order)) != len(order) or not all(s.first <= t < s.last for t in order)):
            raise PlanError(f"{where}: sum_order {order!r} must list distinct layers of the stage")
        if desc is None:
            return
        tops = [b[0] for b in buckets_of({i: desc.layers[i].param_bytes for i in s.layers
                                          if desc.layers[i].param_bytes > 0})]
        if sorted(order) != sorted(tops):
            raise PlanError(f"{where}: sum_order {order} must order the stage's gradient buckets, named by their "
                            f"top layers: {', '.join(map(str, tops))}")

    def _check_single(self, i: int, s: Stage, where: str, desc) -> None:
        if s.replica_count() > 1:
            if len(s.devices) != s.replica_count():
                raise PlanError(f"{where}: {s.replicas} replicas of a single stage take {s.replicas} devices, got "
                                f"{len(s.devices)}")
        elif len(s.devices) != 1:
            raise PlanError(f"{where}: mode single takes one device, got {len(s.devices)}")

    def _check_dp(self, i: int, s: Stage, where: str, desc) -> None:
        if self.batch_size % self.microbatches:
            raise PlanError(f"{where}: a dp stage needs the batch ({self.batch_size}) to split evenly into "
                            f"{self.microbatches} micro-batches")
        mb = self.microbatch_size()
        alloc = s.allocation or {}
        if set(alloc) != set(s.devices):
            raise PlanError(f"{where}: the allocation must give samples for exactly the group's devices {s.devices}")
        if any(v < 0 for v in alloc.values()):
            raise PlanError(f"{where}: negative allocation {alloc}")
        copies = s.replica_count()
        if copies > 1:
            sizes = s.group_sizes()
            if len(sizes) != copies or min(sizes) < 1 or sum(sizes) != len(s.devices):
                raise PlanError(f"{where}: groups {sizes} must give each of the {copies} replicas at least one of "
                                f"the {len(s.devices)} devices, all of them in all")
        for r in range(copies):
            group = s.replica_devices(r)
            total = sum(alloc[d] for d in group)
            if total != mb:
                whose = f"replica {r}'s allocation ({', '.join(group)})" if copies > 1 else "the allocation"
                raise PlanError(f"{where}: {whose} sums to {total} samples, but a micro-batch has {mb} "
                                f"(batch {self.batch_size} / {self.microbatches} micro-batches)")

    def _check_tiles(self, i: int, s: Stage, where: str, desc) -> None:
        if not s.grid or len(s.grid) != 2 or min(s.grid) < 1:
            raise PlanError(f"{where}: a tiles stage needs a grid [rows, cols] of at least 1x1")
        rows, cols = s.grid
        tiles = s.tile_devices or []
        copies = s.replica_count()
        if len(tiles) != rows * cols * copies:
            what = f"{copies} replicas of grid {rows}x{cols} have" if copies > 1 else f"grid {rows}x{cols} has"
            raise PlanError(f"{where}: {what} {rows * cols * copies} tiles but tile_devices lists {len(tiles)}")
        if set(tiles) != set(s.devices):
            raise PlanError(f"{where}: tile_devices must use exactly the stage's devices")
        if copies > 1:
            owners: dict[str, int] = {}
            for r in range(copies):
                for d in s.replica_tiles(r):
                    if owners.setdefault(d, r) != r:
                        raise PlanError(f"{where}: device {d} has tiles in replicas {owners[d]} and {r}; each device "
                                        "belongs to one replica")
        fwd, bwd = s.forward_syncs(), s.backward_syncs()
        if not fwd or fwd[0] != s.first or fwd[-1] >= s.last:
            raise PlanError(f"{where}: forward syncs {fwd} must start at layer {s.first} and lie in {s.first}-{s.last - 1}")
        if not bwd or bwd[-1] != s.last or bwd[0] <= s.first:
            raise PlanError(f"{where}: backward syncs {bwd} must end at boundary {s.last} and lie in {s.first + 1}-{s.last}")
        if s.together is not None:
            share = self.microbatches // copies
            if not 1 <= s.together <= share or share % s.together:
                whose = f"each replica's {share}" if copies > 1 else f"the {share}"
                raise PlanError(f"{where}: together={s.together} must divide {whose} micro-batches")
            if s.together > 1 and len(self.stages) > 1:
                raise PlanError(f"{where}: micro-batches run together (together={s.together}) only in a plan "
                                "with this one stage")
        if desc is None:
            return
        reason = stage_refusal(desc, s.first, s.last)
        if reason is not None:
            raise PlanError(f"{where}: tiles cannot take these layers: {reason}")
        for layer in desc.layers[s.first:s.last]:
            _, h, w = layer.out_shape
            if rows > h or cols > w:
                raise PlanError(f"{where}: grid {rows}x{cols} does not fit the {h}x{w} output of layer {layer.index}")
        reason = missing_syncs(desc.layers[s.first:s.last], fwd, bwd)
        if reason is not None:
            raise PlanError(f"{where}: {reason}")

    # ---- JSON ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["img_size"] = self.img_size.to_json()
        d["backups"] = {str(k): v for k, v in self.backups.items()}
        for s in d["stages"]:
            for key in [k for k, v in s.items() if v is None]:
                del s[key]
        if d["predicted"] is None:
            del d["predicted"]
        if not self.mapped:
            del d["mapped"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("a plan is a JSON object")
        version = d.get("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise PlanError(f"plan version {version} is not supported (this swarm reads version {PLAN_VERSION})")
        known_plan = {"model", "img_size", "batch_size", "microbatches", "stages", "devices", "backups",
                      "predicted", "planner", "mapped", "version"}
        extra = set(d) - known_plan
        if extra:
            raise PlanError(f"unknown plan field(s): {', '.join(sorted(extra))}")
        missing = [k for k in ("model", "img_size", "batch_size", "microbatches", "stages") if k not in d]
        if missing:
            raise PlanError(f"the plan lacks {', '.join(missing)}")
        stages = []
        stage_fields = set(Stage.__dataclass_fields__)
        for i, s in enumerate(d["stages"]):
            if not isinstance(s, dict):
                raise PlanError(f"stage {i} is not an object")
            extra = set(s) - stage_fields
            if extra:
                raise PlanError(f"stage {i}: unknown field(s) {', '.join(sorted(extra))}")
            try:
                s = dict(s)
                if s.get("grid") is not None:
                    s["grid"] = tuple(int(x) for x in s["grid"])
                stages.append(Stage(**s))
            except (TypeError, ValueError) as exc:
                raise PlanError(f"stage {i}: {exc}") from None
        if d.get("mapped", False) not in (False, True):
            raise PlanError(f"mapped is true or false, not {d['mapped']!r}")
        try:
            return cls(model=str(d["model"]), img_size=ImageSize.of(d["img_size"]), batch_size=int(d["batch_size"]),
                       microbatches=int(d["microbatches"]), stages=stages, devices=dict(d.get("devices") or {}),
                       backups={int(k): v for k, v in (d.get("backups") or {}).items()},
                       predicted=d.get("predicted"), planner=str(d.get("planner", "manual")),
                       mapped=bool(d.get("mapped", False)), version=version)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"malformed plan: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise PlanError(f"not valid JSON: {exc}") from None
