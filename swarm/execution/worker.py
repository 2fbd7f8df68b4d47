"""A device's side of a training job: run its stage parts on the 1F1B schedule, move blocks
to and from neighbouring stages, reduce gradients in its groups, and apply a step only when
the coordinator commits it.

A worker runs for one epoch of a job (one plan). It starts by gathering its stages' state at
the epoch's start step, as the spec's moves say: layers it kept itself, layers another
device sends it, or (at the very start) layers from the coordinator. At the backup steps the
coordinator names in its decisions it snapshots its own layers and sends the layers of its
single-device stages to their backup holders (replay.DeviceBackups), so that after a death
the survivors can roll back to that step and replay.

What it receives and sends, and the keys, are in channels.py.
"""
from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass, field

import torch
import trio

from planner.plan import Plan
from planner.routing import Layout, Part, parts_on, runs, stage_parts
from planner.schedule import overlap_units, stage_schedule
from swarm.data import microbatch_bounds, sample_keys
from swarm.execution import channels
from swarm.execution.blocks import BlockPost
from swarm.execution.channels import COORDINATOR
from swarm.execution.collectives import allgather
from swarm.execution.endpoint import Endpoint
from swarm.execution.group_bn import merge_running_stats, replay_running_stats
from swarm.execution.halos import DeviceTiles, TileGeometry
from swarm.execution.reduce import GradReducer
from swarm.execution.replay import DeviceBackups, DeviceStore, layer_of, layers_in, missing_holding
from swarm.execution.stage import StageCopy
from swarm.execution.threads import LOCK_POLL_S, ComputeLock, call_in_loop, check_cancelled
from swarm.host.resources import cpu_quota
from swarm.local.compute_device import HOST, plan_device
from swarm.local.trainer import TrainConfig
from swarm.zoo import describe_model
from tiles.executor import TileWorker


@dataclass
class JobSpec:
    plan: Plan
    cfg: TrainConfig
    cfg_text: str | None
    timeout_s: float = 120.0  # longest wait for any one message before the job is given up
    threads: int | None = None
    epoch: int = 0
    start_step: int = 0  # committed steps the epoch starts from
    moves: list = field(default_factory=list)  # planner.backups.Move: where each stage's layers come from
    backup_interval: int = 0  # back up every this many committed steps; 0: by time (coordinator.BACKUP_SHARE)

    def spec_fields(self) -> dict:
        return {"epoch": self.epoch, "start_step": self.start_step, "moves": [m.to_dict() for m in self.moves]}


def _thread_sys_s() -> float:
    """The calling thread's CPU seconds in the kernel (0 where the system cannot say)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_stime if who is not None else 0.0


def quota_share(compute_on) -> float | None:
    """The cores a compute thread on this host gets under a cgroup CPU quota below one core,
    as the planner plans it: the quota (the runtime's own CPU is charged apart, a step at a
    time: swarm.profiling.survey.RUNTIME_STEP_CPU_S). None without such a quota, or computing
    on an accelerator."""
    quota = cpu_quota()
    if compute_on != HOST or quota is None or quota >= 1:
        return None
    return quota


class DeviceWorker:
    def __init__(self, endpoint: Endpoint, job: JobSpec, store: DeviceStore | None = None):
        self.ep = endpoint
        self.job = job
        self.backups = DeviceBackups(endpoint, job.plan, store if store is not None else DeviceStore(), job.timeout_s)
        self.plan = job.plan
        self.cfg = job.cfg
        self.device = endpoint.name
        self.compute_on = plan_device(self.plan.devices.get(self.device, {}))  # its accelerator, or the host
        self.parts = parts_on(self.plan, self.device)
        self.copies: dict[int, StageCopy] = {}
        self.tile_workers: dict[int, dict] = {}
        self.layout: Layout | None = None
        self.compute_lock = ComputeLock()
        self.busy_s = 0.0
        self.compute_cpu_s = 0.0  # CPU time of the compute itself (busy_s is wall time, quota stalls included)
        # ... of which in the kernel: on a kernel that charges softirqs to the thread they
        # interrupt, the network's work lands here (bench/RESULTS.md, 2026-11-30 20:50 UTC)
        self.compute_sys_s = 0.0
        self.exchange_s = 0.0  # of busy_s, the wall time the compute waited for its group's BatchNorm sums
        self.gate_s = 0.0  # of busy_s, the wall time a forward waited for the step before's updates
        self.tail: Tail | None = None  # the step before's sums, updates and merges, while they are under way
        # the next step starts while the step before's sums are still travelling, its forward
        # waiting layer by layer for their updates (Tail); a tiles stage's layers run in its
        # tile executors, past those gates, so a device with one ends every step settled
        self.overlapping = True
        self.share = quota_share(self.compute_on)
        self.token = None  # trio token, for exchanges from compute threads
        # a replicated tiles stage: {(micro-batch, layer): (mean, var, count)} of our replica's
        # micro-batches this step, replayed with the other replicas' in micro-batch order
        self.bn_stats: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}

    # ---- helpers ---------------------------------------------------------------------
    async def get(self, key):
        return await self.ep.mailbox.get(key, self.job.timeout_s)

    async def compute(self, fn, *args):
        def run():
            with self.compute_lock:
                t0, c0, k0 = time.perf_counter(), time.thread_time(), _thread_sys_s()
                try:
                    return fn(*args)
                finally:
                    self.busy_s += time.perf_counter() - t0
                    self.compute_cpu_s += time.thread_time() - c0
                    self.compute_sys_s += _thread_sys_s() - k0
        return await trio.to_thread.run_sync(run)

    def own_s(self) -> float:
        """This step's own compute as the device's profile counts it (what re-costing sets
        against the cost model): under a CPU quota below a core, the compute thread's CPU time
        over the share the planner gives it (quota_share), for the busy time there also holds
        the quota's stalls while the event loop sends and sums gradients, which the cost model
        charges apart; elsewhere the busy time, less the waits for the group's BatchNorm sums
        and for the step before's updates."""
        if self.share is not None and torch.get_num_threads() == 1:
            return self.compute_cpu_s / self.share
        return max(0.0, self.busy_s - self.exchange_s - self.gate_s)

    def gate_hook(self, gate: threading.Event):
        """A forward pre-hook: the layer's weights wait for the step before's update (its
        bucket's sum, then the commit), with the compute lock let go."""
        def hook(module, inputs) -> None:
            if gate.is_set():
                return
            t0 = time.perf_counter()
            try:
                with self.compute_lock.released():
                    while not gate.wait(LOCK_POLL_S):
                        check_cancelled()
            finally:
                self.gate_s += time.perf_counter() - t0
        return hook

    def group_of(self, p: int) -> list[str]:
        """The devices stage p's gradients are summed over: all of its devices."""
        return list(self.plan.stages[p].devices)

    def bn_group_of(self, p: int) -> list[str]:
        """The devices sharing this device's micro-batches of stage p (its BatchNorm sums): the
        stage's devices, or in a replicated dp stage this device's replica."""
        stage = self.plan.stages[p]
        for r in range(stage.replica_count()):
            if self.device in stage.replica_devices(r):
                return stage.replica_devices(r)
        return list(stage.devices)

    def bn_exchange(self, step: int, p: int, m: int, layer: str):
        """The group BatchNorm exchange for one layer of one micro-batch (called from the
        compute thread; blocks it, with the compute lock released, until the group answers or
        the job is cancelled)."""
        group = self.bn_group_of(p)

        def exchange(tag: str, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
            key = channels.bn(step, p, m, layer, tag)
            t0 = time.perf_counter()
            try:
                with self.compute_lock.released():
                    return call_in_loop(allgather, self.ep, group, key, tensors, self.job.timeout_s, token=self.token)
            finally:
                self.exchange_s += time.perf_counter() - t0
        return exchange

    # ---- the job ---------------------------------------------------------------------
    async def run(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        if self.job.threads:
            torch.set_num_threads(self.job.threads)
        desc = describe_model(self.cfg.model, self.plan.img_size, self.cfg.classes, self.job.cfg_text)
        self.desc = desc
        self.tile_geometry = TileGeometry(self.plan, desc)
        self.layout = Layout(self.plan, desc, self.tile_geometry)
        self.post = BlockPost(self.ep, self.plan, desc, self.layout, self.job.timeout_s)
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await self.restore()
            step = self.job.start_step
            await self.back_up(step)
            while not await self.run_step(step):
                step += 1
            await self.get(channels.stop())
            nursery.cancel_scope.cancel()

    async def restore(self) -> None:
        """Build this device's stages and load their state at the start step: send what
        others need of ours, take what we kept, receive the rest."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.backups.send_moves, self.job.moves, self.job.start_step)
            for p in sorted({part.stage for part in self.parts}):
                nursery.start_soon(self._build_stage, p)

    async def _build_stage(self, p: int) -> None:
        copy = await trio.to_thread.run_sync(StageCopy.build, self.plan, p, self.cfg, self.job.cfg_text,
                                             len(self.bn_group_of(p)), self.compute_on)
        states = await self.backups.states_for(p, self.job.moves)
        missing = {layer_of(k) for k in copy.net.state_dict()} - layers_in(states)
        lacking = missing_holding(self.job.moves, self.device, p, missing) if missing else None
        if lacking is not None:
            raise lacking
        await trio.to_thread.run_sync(copy.load_states, states)
        self.copies[p] = copy
        if copy.stage.mode == "tiles":
            self.tile_workers[p] = self.make_tile_workers(copy)
            self.overlapping = False
        else:
            for layer, gate in copy.gates.items():
                copy.net.layers[layer].register_forward_pre_hook(self.gate_hook(gate))

    async def back_up(self, step: int) -> None:
        """At a backup step: our stages' states (our own copies: kept as the snapshot and sent
        from, never changed) to replay, which keeps and sends them in the background."""
        states = {p: await trio.to_thread.run_sync(copy.states) for p, copy in self.copies.items()}
        self.backups.back_up(step, states, self.nursery)

    def make_tile_workers(self, copy: StageCopy) -> dict:
        lay = self.tile_geometry.layout(copy.p)
        stage = copy.stage
        modules = [copy.net.layers[i] for i in range(stage.first, stage.last)]
        mine = [part.index for part in self.parts if part.stage == copy.p]
        lock = threading.Lock()
        # each device's copy of the weights: its first tile advances the BN running statistics
        workers = {k: TileWorker(lay, k % lay.n_tiles, modules, keeps_running_stats=k == mine[0], grad_lock=lock)
                   for k in mine}
        if stage.replica_count() > 1:  # only this replica's micro-batches: kept, to be replayed with all the others
            workers[mine[0]].running_stats_sink = lambda m, layer, mean, var, count: \
                self.bn_stats.__setitem__((m, layer), (mean.clone(), var.clone(), count))
        return workers

    async def run_step(self, step: int) -> bool:
        self.busy_s = self.compute_cpu_s = self.compute_sys_s = self.exchange_s = self.gate_s = 0.0
        cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if self.tail is None:  # settled: the running statistics are the step's start (a tail leaves them at zero)
            for copy in self.copies.values():
                if copy.stage.mode != "tiles" and copy.stage.replica_count() > 1:
                    copy.running_from_zero()
        self.ep.mailbox.waited.clear()
        losses: list[float] = []
        t0 = trio.current_time()
        before = self.tail
        self.reducers = {p: self.make_reducer(step, p) for p in self.copies if len(self.group_of(p)) > 1}
        async with trio.open_nursery() as stages:
            for p in sorted(self.copies):
                stages.start_soon(self.run_stage, step, p, losses)
        tail = self.begin_tail(step)
        times = {"schedule_s": tail.start - t0, "gate_s": self.gate_s,
                 "compute_cpu_s": self.compute_cpu_s, "compute_sys_s": self.compute_sys_s,
                 "exchange_s": self.exchange_s, "own_s": self.own_s(),
                 "cpu_s": time.process_time() - cpu0,
                 "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0,
                 **({"tail_s": before.seconds, "reducing_s": before.reducing_s} if before and before.done.is_set() else {}),
                 **{f"wait_{k}_s": v for k, v in self.ep.mailbox.waited.items()}}
        await self.ep.send(COORDINATOR, channels.ready(step, self.device),
                           {"loss": float(sum(losses)), "busy_s": self.busy_s - self.gate_s, "times": times})
        decision = await self.get(channels.decide(step))
        self.nursery.start_soon(self.finish_tail, tail, decision)
        last = bool(decision.get("last"))
        backup = decision["commit"] and decision.get("backup")
        if not self.overlapping or last or decision.get("checkpoint") or backup or not decision["commit"]:
            await self.settle()
        committed = step + 1
        if decision.get("checkpoint"):
            for p, copy in self.copies.items():
                if stage_parts(self.plan, p)[0].device == self.device:
                    states = await trio.to_thread.run_sync(copy.states)
                    await self.ep.send(COORDINATOR, channels.state(committed, p, self.device), {"states": states})
        if backup:
            await self.back_up(committed)
        return last

    # ---- what a step leaves for the next to overlap --------------------------------------
    def begin_tail(self, step: int) -> "Tail":
        """After the step's last backward: the sums not yet started start, the replicated
        stages' running statistics go to be merged, and the gates close until the updates."""
        tail = Tail(step, trio.current_time(), self.reducers)
        for reducer in self.reducers.values():
            reducer.start_rest()
        for p, copy in self.copies.items():
            if copy.stage.replica_count() > 1:
                merged = tail.merged[p] = trio.Event()
                if copy.stage.mode == "tiles":
                    self.nursery.start_soon(self.replay_stats, step, p, copy, merged)
                else:
                    before = self.tail.merged.get(p) if self.tail is not None else None
                    self.nursery.start_soon(self.merge_stats, step, p, copy, copy.take_moved(), before, merged)
            for gate in copy.gates.values():
                gate.clear()
        self.tail = tail
        return tail

    async def finish_tail(self, tail: "Tail", decision: dict) -> None:
        """Each bucket's update once its sum is in and the step is committed (layers of a
        stage that sums nothing: all at once), opening its layers' gates; then the merges."""
        async with trio.open_nursery() as nursery:
            for p, copy in self.copies.items():
                reducer = tail.reducers.get(p)
                for bucket in (reducer.buckets if reducer else [None]):
                    nursery.start_soon(self.update, tail.step, copy, reducer, bucket, decision["commit"])
            for merged in tail.merged.values():
                nursery.start_soon(merged.wait)
        tail.reducing_s = sum(r.seconds for r in tail.reducers.values())
        tail.seconds = trio.current_time() - tail.start
        tail.done.set()
        if decision["commit"] and not decision.get("last"):  # the coordinator sends the samples of the step after next
            await self.ep.send(COORDINATOR, channels.summed(tail.step, self.device), {})

    async def update(self, step: int, copy: StageCopy, reducer: GradReducer | None, bucket: int | None,
                     commit: bool) -> None:
        if reducer is None:
            params, layers = list(copy.net.parameters()), list(copy.gates)
        else:
            await reducer.summed(bucket)
            params, layers = reducer.bucket_params(bucket), reducer.buckets[bucket]
        await trio.to_thread.run_sync(copy.apply_params, step, params, commit)
        for layer in layers:
            if layer in copy.gates:
                copy.gates[layer].set()

    async def settle(self) -> None:
        """Wait for the step before's tail: every update applied and the running statistics
        merged into the BatchNorm layers (a backup, a checkpoint, the last step need them)."""
        if self.tail is None:
            return
        await self.tail.done.wait()
        for copy in self.copies.values():
            if copy.stage.mode != "tiles" and copy.stage.replica_count() > 1:
                copy.set_running(copy.start_stats)
                copy.start_stats = []
        self.tail = None

    async def merge_stats(self, step: int, p: int, copy: StageCopy, moved, before, merged: trio.Event) -> None:
        await merge_running_stats(self.ep, step, p, copy, moved, self.plan.microbatches, self.job.timeout_s, before)
        merged.set()

    async def replay_stats(self, step: int, p: int, copy: StageCopy, merged: trio.Event) -> None:
        """A replicated tiles stage's BatchNorm running statistics, as one device running every
        micro-batch in order would have them (group_bn.py)."""
        mine = [part.index for part in self.parts if part.stage == p]
        ours, self.bn_stats = self.bn_stats, {}
        await replay_running_stats(self.ep, step, p, copy.stage, mine, ours, self.tile_workers[p][mine[0]].parts,
                                   self.job.timeout_s)
        merged.set()

    def make_reducer(self, step: int, p: int) -> GradReducer:
        """The step's sums of stage p; they run in the job's nursery, past the step's end."""
        copy = self.copies[p]
        parts = len([part for part in self.parts if part.stage == p])
        return GradReducer(self.ep, self.group_of(p), channels.grads(step, p), copy.net, copy.stage.first,
                           copy.stage.last, self.nursery, self.job.timeout_s, self.token, parts,
                           getattr(self.ep, "lanes", None), p, copy.stage.sum_order,
                           self.plan.stages[p].sum_weights(self.plan.microbatches))

    async def run_stage(self, step: int, p: int, losses: list[float]) -> None:
        """The 1F1B schedule of this device's parts of stage p for one step. During the last
        backward, layers whose gradients are final start being summed over the group."""
        plan = self.plan
        copy = self.copies[p]
        my_parts = [part for part in self.parts if part.stage == p]
        bounds = microbatch_bounds(plan.batch_size, plan.microbatches)
        tiled = copy.stage.mode == "tiles"
        reducer = self.reducers.get(p)
        if tiled:  # in blocks of `together` micro-batches (one block = one schedule unit)
            size = copy.stage.block()
            mine = [m for m in range(plan.microbatches) if runs(plan, my_parts[0], m)]  # our replica's
            ops = stage_schedule(len(mine) // size, plan.warmups()[p])
            for i, (kind, j) in enumerate(ops):
                block = [(m, *bounds[m]) for m in mine[j * size:(j + 1) * size]]
                if kind == "F":
                    await self.tiles_forward(step, copy, my_parts, block, losses)
                else:
                    final = reducer is not None and i == len(ops) - 1  # the step's last backward
                    for worker in self.tile_workers[p].values():
                        worker.on_layer_done = (lambda mb, layer: reducer.layer_done_from_thread(layer)) \
                            if final else None
                    await self.tiles_backward(step, copy, my_parts, block)
            return
        mine = [m for m in range(plan.microbatches) if runs(plan, my_parts[0], m)]  # our replica's
        ops = stage_schedule(len(mine), plan.warmups()[p])
        last = ops[-1]

        async def run_op(op) -> None:
            kind, j = op
            m = mine[j]
            lo, hi = bounds[m]
            final = reducer is not None and op == last  # the step's last backward
            handles = reducer.hooks() if final else []
            try:
                for part in my_parts:
                    if kind == "F":
                        await self.forward(step, copy, part, m, lo, hi, losses, sends)
                    else:
                        await self.backward(step, copy, part, m, hi - lo, sends)
            finally:
                for h in handles:
                    h.remove()

        # overlapping: a backward and the next forward side by side, each computing while the
        # other waits for its group (the compute lock lets go during a BatchNorm exchange).
        # What an op sends to the next stage or the one before goes while the next op computes
        # (`sends`); the schedule ends once all of it has gone.
        async with trio.open_nursery() as sends:
            for unit in overlap_units(ops) if copy.stage.overlap else [[op] for op in ops]:
                if len(unit) == 1:
                    await run_op(unit[0])
                    continue
                async with trio.open_nursery() as both:
                    for op in unit:
                        both.start_soon(run_op, op)

    # ---- single and dp parts ---------------------------------------------------------
    async def forward(self, step: int, copy: StageCopy, part: Part, m: int, lo: int, hi: int, losses,
                      sends: trio.Nursery | None = None) -> None:
        p, mb = part.stage, hi - lo
        inputs = await self.post.gather_inputs(step, part, m, mb)
        targets = None
        if copy.is_last:
            targets = (await self.get(channels.targets(step, part.index, m)))["arrays"][0]
        span = self.layout.inputs(p, mb)[part.index].block.samples
        keys = sample_keys(step, range(lo + span[0], lo + span[1]))
        for name, bn in copy.group_bns:
            bn.exchange = self.bn_exchange(step, p, m, name)
        outputs = await self.compute(copy.forward, part.index, m, inputs, keys, targets, plan_batch(self.plan))
        if copy.is_last:
            losses.append(await self.compute(copy.loss_value, part.index, m))
        else:
            await _handed(sends, self.post.send_outputs, step, part, m, mb, outputs)

    async def backward(self, step: int, copy: StageCopy, part: Part, m: int, mb: int,
                       sends: trio.Nursery | None = None) -> None:
        grads = None if copy.is_last else await self.post.gather_output_grads(step, part, m, mb)
        in_grads = await self.compute(copy.backward, part.index, m, grads)
        if part.stage > 0:
            await _handed(sends, self.post.send_input_grads, step, part, m, mb, in_grads)

    # ---- tiles parts -----------------------------------------------------------------
    async def tiles_forward(self, step: int, copy: StageCopy, parts: list[Part], block: list[tuple[int, int, int]],
                            losses) -> None:
        """Forward of a block of micro-batches [(m, lo, hi), ...] through this device's tiles."""
        p = copy.p
        first = copy.stage.first
        key_in = -1 if first == 0 else first - 1
        sizes = [hi - lo for _, lo, hi in block]
        gens = {}
        for part in parts:
            xs = [(await self.post.gather_inputs(step, part, m, hi - lo))[key_in] for m, lo, hi in block]
            x = (xs[0] if len(xs) == 1 else torch.cat(xs)).to(self.compute_on, non_blocking=True)
            gens[part.index] = self.tile_workers[p][part.index].forward(block[0][0], x,
                                                                        sizes if len(sizes) > 1 else None)
        outs = await self._run_tiles(step, copy, gens)
        for part in parts:
            pieces = torch.split(outs[part.index], sizes)
            for (m, lo, hi), out in zip(block, pieces):
                if copy.is_last:
                    targets = (await self.get(channels.targets(step, part.index, m)))["arrays"][0]
                    losses.append(await self.compute(copy.tile_loss, part.index, m, out, targets,
                                                     plan_batch(self.plan), self._window(p, part.index)))
                else:
                    await self.post.send_outputs(step, part, m, hi - lo, {copy.stage.last - 1: out})

    async def tiles_backward(self, step: int, copy: StageCopy, parts: list[Part], block: list[tuple[int, int, int]]) -> None:
        p = copy.p
        last_map = copy.stage.last - 1
        dys = {}
        for part in parts:
            if copy.is_last:
                pieces = [copy.tile_dy.pop((part.index, m)) for m, _, _ in block]
            else:
                pieces = [(await self.post.gather_output_grads(step, part, m, hi - lo))[last_map] for m, lo, hi in block]
            dys[part.index] = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(self.compute_on,
                                                                                       non_blocking=True)
        gens = {k: self.tile_workers[p][k].backward(block[0][0], dy) for k, dy in dys.items()}
        dxs = await self._run_tiles(step, copy, gens)
        if p > 0:
            key_in = copy.stage.first - 1
            sizes = [hi - lo for _, lo, hi in block]
            for part in parts:
                for (m, lo, hi), dx in zip(block, torch.split(dxs[part.index], sizes)):
                    await self.post.send_input_grads(step, part, m, hi - lo, {key_in: dx})

    async def _run_tiles(self, step: int, copy: StageCopy, gens: dict[int, object]) -> dict[int, object]:
        """Run our tiles' generators (keyed by part index) with the other tiles of their replica."""
        n = copy.stage.tiles_per_replica()
        r = min(gens) // n
        local = await DeviceTiles(self, step, copy.p, copy.stage.replica_tiles(r)).run(
            {k - r * n: gen for k, gen in gens.items()})
        return {k + r * n: v for k, v in local.items()}

    def _window(self, p: int, tile: int) -> tuple[int, int, int, int]:
        """(row0, col0, H, W) of a tile's owned output in the stage's output map."""
        lay = self.tile_geometry.layout(p)
        rect = lay.output_rect(tile % lay.n_tiles)
        _, h, w = lay.map_shape(lay.last)
        return rect.rows.lo, rect.cols.lo, h, w


def plan_batch(plan: Plan) -> int:
    return plan.batch_size


@dataclass
class Tail:
    """What a step leaves after its last backward, under way while the next step runs: its
    gradient sums (reducers), its updates, its replicated stages' running statistics merged."""

    step: int
    start: float  # trio time at the step's last backward
    reducers: dict[int, GradReducer]
    merged: dict[int, trio.Event] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)
    seconds: float = 0.0  # from `start` to done
    reducing_s: float = 0.0


async def _handed(sends: trio.Nursery | None, send, *args) -> None:
    """Run `send` (a BlockPost send of an op's tensors) in `sends`, beside the ops that follow:
    a megabyte of activations takes a tenth of a second of a 100 Mbit link, and a gradient
    for a device that is computing waits until that device's CPU takes it in. Without a
    nursery, at once."""
    if sends is None:
        await send(*args)
    else:
        sends.start_soon(send, *args)
