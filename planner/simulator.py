"""The simulator: any Plan -> the timeline of one training step on every device.

Each stage runs its micro-batches in the order `stage_schedule(M, K_p)` gives (the same
function the workers follow). A device serving several stages keeps one such queue per
stage and, whenever it is free, runs the head of the queue that became ready first (ties:
the later stage, so the pipeline drains, then backward before forward). Split stages in
lock-step (dp with BatchNorm, tiles) start each micro-batch when all their devices are
free and ready.

Transfers: forward activations and backward gradients between the devices holding the
same samples in consecutive stages, input images from the data source. Every device has
one uplink and one downlink; a transfer occupies both ends' links for latency + bytes /
bandwidth (plus, at an end that computes on an accelerator, the message's copy between the
accelerator and the host: `Cluster.transfer_time`), first come first served, and overlaps
with computation — except for the CPU it costs its ends (bytes x time per byte moved, plus
the time per message): each device pays what its idle time since its last computation did
not cover before its next one (or at the end of the step), since on a small device the
sockets and the layers share one CPU. After its last backward a group all-reduces its
gradients; when every group is done, the step commits (a round trip to the data source's
coordinator: two message latencies) and each device runs the optimizer step on its stages.
That is a settled step (`Timeline.settled_s`: the first, the last, one with a backup); the
steps between run over the sums of the step before, and the step time is that overlapped
step's (`_Run.overlapped`).

    timeline = simulate(plan, desc, mem, cluster)
    timeline.step_time, timeline.throughput, timeline.peak_memory["pi-1"]
"""
from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace

import numpy as np

from planner.backups import backup_holders
from planner.checkpoint import checkpointing
from planner.mapping import mapping
from planner.cluster import Cluster
from planner.memory import MemoryModel
from planner.model_desc import ModelDesc
from planner.plan import Plan, PlanError
from planner.recompute import recomputing
from planner.schedule import stage_schedule
from planner.buckets import buckets_of, sum_sequence
from planner.stage_work import (IMAGE_BYTES_PER_VALUE, StageWork, allreduce_cpu, best_sum_order, gate_wait,
                                gradient_buckets, microbatch_sizes, ring_allreduce_time, split_stage_work)
from planner.tiles_work import tiles_stage_work
from planner.units import format_bytes

EPS = 1e-12


@dataclass
class Event:
    device: str
    kind: str  # F | B | update | send | input | allreduce
    stage: int
    micro: int | None
    start: float
    end: float
    peer: str | None = None  # the receiving device of a transfer
    nbytes: float = 0.0

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Overflow:
    device: str
    need: float
    have: float
    stages: list[int]

    def message(self) -> str:
        which = ", ".join(str(s) for s in self.stages)
        return (f"stage{'s' if len(self.stages) > 1 else ''} {which} need{'s' if len(self.stages) == 1 else ''} "
                f"{format_bytes(self.need)} on device {self.device}, which has {format_bytes(self.have)} "
                f"({format_bytes(self.need - self.have)} short)")


@dataclass
class Timeline:
    events: list[Event]
    step_time: float
    batch_size: int
    peak_memory: dict[str, float]  # bytes at the busiest moment of the step
    eq3_memory: dict[str, float]  # Asteroid eq. 3 summed over each device's stages
    budgets: dict[str, float]
    busy: dict[str, float]  # seconds of computation per device
    works: list[StageWork] = field(default_factory=list, repr=False)
    settled_s: float = 0.0  # a step that waits for its own sums and updates (the first, the last, one with a backup)
    # per stage that sums: its buckets, when each is final, its sum's seconds, each device's
    # updates and reach (_Run.gate_ahead); and the commit
    gates: dict = field(default_factory=dict, repr=False)
    commit: float = 0.0

    def best_sum_orders(self) -> dict[int, list[int]]:
        """For each stage summing more than one bucket, the order of its sums that starts the
        next step soonest on this step's times (stage_work.best_sum_order)."""
        return {p: best_sum_order(buckets, final, seconds, self.commit, ahead)
                for p, (buckets, final, seconds, ahead) in self.gates.items() if len(buckets) > 1}

    @property
    def throughput(self) -> float:
        return self.batch_size / self.step_time if self.step_time > 0 else float("inf")

    def overflows(self, plan: Plan) -> list[Overflow]:
        out = []
        for d, need in self.peak_memory.items():
            if need > self.budgets[d]:
                out.append(Overflow(d, need, self.budgets[d], plan.stages_of_device(d)))
        return sorted(out, key=lambda o: o.have - o.need)

    @property
    def fits(self) -> bool:
        return all(self.peak_memory[d] <= self.budgets[d] for d in self.peak_memory)

    def summary(self) -> dict:
        """What a Plan records as `predicted`."""
        return {"step_time_s": self.step_time, "settled_step_s": self.settled_s or self.step_time,
                "throughput": self.throughput,
                "peak_memory": {d: int(v) for d, v in self.peak_memory.items()},
                "memory_left": {d: int(self.budgets[d] - v) for d, v in self.peak_memory.items()},
                "busy_s": {d: v for d, v in self.busy.items()}, "fits": self.fits}


def kept_states(plan: Plan, mem: MemoryModel, backups: dict[int, str] | None = None) -> dict[str, float]:
    """Bytes each device keeps of weights and optimizer state beside its working copy: the
    snapshot of its own stages and the backup of each stage it holds for another device
    (`backups`, by default the plan's)."""
    kept: dict[str, float] = {}
    for s in plan.stages:
        for d in set(s.devices):
            kept[d] = kept.get(d, 0.0) + mem.state(s.first, s.last)
    if backups is None:
        backups = plan.backups or backup_holders(plan)
    for p, holder in backups.items():
        s = plan.stages[p]
        if holder not in s.devices:
            kept[holder] = kept.get(holder, 0.0) + mem.state(s.first, s.last)
    return kept


def backups_with_room(plan: Plan, mem: MemoryModel, timeline: Timeline) -> dict[int, str]:
    """Backup holders chosen for memory rather than by the pipeline's order: each stage that
    needs a backup (backup_holders), the largest first, goes to the device other than its
    own with the most memory left over (`timeline`'s peaks without any backup)."""
    topology = backup_holders(plan)
    with_backups, own = kept_states(plan, mem, topology), kept_states(plan, mem, {})
    left = {d: timeline.budgets[d] - (peak - mem.kept_charge(with_backups.get(d, 0.0))
                                      + mem.kept_charge(own.get(d, 0.0)))
            for d, peak in timeline.peak_memory.items()}
    chosen = {}
    for p in sorted(topology, key=lambda q: -mem.state(plan.stages[q].first, plan.stages[q].last)):
        stage = plan.stages[p]
        size = mem.state(stage.first, stage.last)
        holder = max((d for d in left if d not in stage.devices), key=lambda d: left[d], default=topology[p])
        chosen[p] = holder
        left[holder] = left.get(holder, 0.0) - size
    return chosen


def stage_works(plan: Plan, desc: ModelDesc, mem: MemoryModel, cluster: Cluster) -> list[StageWork]:
    """What each stage asks of its devices, by its mode: planner/tiles_work.py for tiles,
    planner/stage_work.py for single and dp."""
    sizes = microbatch_sizes(plan.batch_size, plan.microbatches)
    for s in plan.stages:
        for d in s.devices:
            cluster.index(d)  # raises a clear error for a device the cluster lacks
    last_stage = len(plan.stages) - 1
    works = []
    for p, stage in enumerate(plan.stages):
        if stage.mode == "tiles":
            works.append(tiles_stage_work(p, stage, plan, desc, mem, cluster, sizes, p == last_stage))
        else:
            works.append(split_stage_work(p, stage, desc, mem, cluster, sizes, p == last_stage, plan.warmups()[p],
                                          len(plan.stages) > 1))
    return works


def simulate(plan: Plan, desc: ModelDesc, mem: MemoryModel, cluster: Cluster, validate: bool = True) -> Timeline:
    if validate:
        plan.validate(desc)
    if plan.recomputes() and plan.checkpoints():
        raise PlanError("a plan remakes BatchNorm or checkpoints its segments, not both")
    if plan.recomputes():
        mem, cluster = recomputing(mem, cluster, desc)
    if plan.checkpoints():
        mem, cluster = checkpointing(mem, cluster, desc)
    if plan.mapped:
        try:
            mem, cluster = mapping(mem, cluster, desc)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
    stage = plan.stages[0]
    if len(plan.stages) > 1 or stage.replica_count() == 1:
        blocks = plan.in_blocks()
        return _Run(blocks, desc, mem, cluster, stage_works(blocks, desc, mem, cluster)).run()
    # replicas: each runs its share on its own devices, all at once, and the gradient ring
    # over every replica's devices ends the step; the slowest replica is the step
    summed = float(mem.param_bytes[stage.first:stage.last].sum())
    everyone = list(dict.fromkeys(stage.tile_devices if stage.mode == "tiles" else stage.devices))
    buckets = gradient_buckets(mem, stage.first, stage.last)
    weights = stage.sum_weights(plan.microbatches)
    ring = ring_allreduce_time(summed, everyone, cluster, buckets, weights)
    own = allreduce_cpu(summed, everyone, cluster, buckets, weights)
    timelines = []
    for r in range(stage.replica_count()):
        alone = plan.replica_plan(r).in_blocks()
        works = stage_works(alone, desc, mem, cluster)
        works[0] = replace(works[0], allreduce=ring, reduce_cpu={d: own[d] for d in works[0].devices if d in own})
        timelines.append(_Run(alone, desc, mem, cluster, works).run())
    slowest = max(timelines, key=lambda t: t.step_time)
    return replace(slowest, batch_size=plan.batch_size,
                   peak_memory={d: v for t in timelines for d, v in t.peak_memory.items()},
                   eq3_memory={d: v for t in timelines for d, v in t.eq3_memory.items()},
                   budgets={d: v for t in timelines for d, v in t.budgets.items()},
                   busy={d: v for t in timelines for d, v in t.busy.items()})


class _Run:
    """One simulated step (a discrete-event simulation)."""

    def __init__(self, plan: Plan, desc: ModelDesc, mem: MemoryModel, cluster: Cluster, works: list[StageWork]):
        self.plan, self.desc, self.mem, self.cluster, self.works = plan, desc, mem, cluster, works
        self.M = plan.microbatches
        self.P = len(works)
        self.heap: list = []
        self.seq = 0
        self.events: list[Event] = []
        self.deps: dict = {}
        self.ready: dict = {}
        self.busy: dict[str, bool] = {}
        self.waiting: dict[str, tuple | None] = {}
        self.joined: dict = defaultdict(set)
        self.up_free: dict[str, float] = defaultdict(float)
        self.down_free: dict[str, float] = defaultdict(float)
        self.queues: dict[str, list[tuple[int, deque]]] = defaultdict(list)
        self.last_b_end: dict[int, float] = defaultdict(float)
        self.b_left: dict[int, int] = {}
        self.reduced_left = 0
        self.to_dispatch: set[str] = set()
        self.t_end = 0.0
        self.debt: dict[str, float] = defaultdict(float)  # CPU seconds transfers took, not yet paid
        self.free_at: dict[str, float] = defaultdict(float)  # when each device's last computation ended
        self.gates: dict[int, tuple] = {}  # what overlapped found of each summing stage's gates
        self.first_forward: dict[tuple[int, str], Event] = {}  # (stage, device) -> its first forward in the step
        self.commit = 0.0

    # ---- set-up ----------------------------------------------------------------------
    def op_devices(self, op) -> list[str]:
        kind, p, m, dev = op
        return list(self.works[p].devices) if dev is None else [dev]

    def op_key(self, kind: str, p: int, m: int | None, dev: str):
        return (kind, p, m, None) if (self.works[p].gang and kind in "FB") else (kind, p, m, dev)

    def build(self) -> None:
        warm = self.plan.warmups()
        for p, w in enumerate(self.works):
            for d in w.devices:  # its micro-batches (a replica's only its own) in the stage's order
                mine = [m for m in range(self.M) if w.gang or any(sh.device == d for sh in w.shares[m])]
                q = deque(self.op_key(k, p, mine[j], d) for k, j in stage_schedule(len(mine), warm[p])) \
                    if mine else deque()
                q.append(("U", p, None, d))
                self.queues[d].append((p, q))
                self.debt[d] = self.cluster.device(d).step_s  # the runtime's own CPU in the step
                self.busy[d] = False
                self.waiting[d] = None
            self.b_left[p] = self.M if w.gang else sum(len(sh) for sh in w.shares)
        self.reduced_left = len(self.works)
        for p, w in enumerate(self.works):
            for m in range(self.M):
                for sh in w.shares[m]:
                    f = self.op_key("F", p, m, sh.device)
                    b = self.op_key("B", p, m, sh.device)
                    self.deps.setdefault(f, 0)
                    self.deps.setdefault(b, 0)
                    if p > 0:
                        self.deps[f] += sum(1 for _ in self._links(p - 1, m, sh))
                    if p < self.P - 1:
                        self.deps[b] += sum(1 for _ in self._links_back(p, m, sh))
                    else:
                        self.deps[b] = 1  # the loss: right after the same micro-batch's forward
            for d in w.devices:
                self.deps[("U", p, None, d)] = 1  # the commit, after every group's all-reduce
        # images from the data source, in micro-batch order
        src = self.cluster.data_source
        image = self.desc.input_bytes // 4 * IMAGE_BYTES_PER_VALUE
        for m in range(self.M):
            for sh in self.works[0].shares[m]:
                op = self.op_key("F", 0, m, sh.device)
                if src is None or src == sh.device:
                    continue
                self.deps[op] += 1
                self.transfer(0.0, src, sh.device, sh.samples * image * sh.frac_in, op, "input", 0, m)
        for op, n in list(self.deps.items()):
            if n == 0 and op[0] != "U":
                self.set_ready(op, 0.0)

    def _links(self, p: int, m: int, consumer):
        """(producer share, bytes) feeding `consumer` of stage p + 1 from stage p."""
        cut = self.works[p + 1].stage.first
        per_sample = self.mem.boundary(cut)
        for sh in self.works[p].shares[m]:
            n = min(sh.hi, consumer.hi) - max(sh.lo, consumer.lo)
            if n > 0:
                yield sh, n * per_sample * sh.frac_out * consumer.frac_in

    def _links_back(self, p: int, m: int, producer):
        """(consumer share in stage p + 1, bytes of gradient) flowing back to `producer`."""
        cut = self.works[p + 1].stage.first
        per_sample = self.mem.boundary(cut)
        for sh in self.works[p + 1].shares[m]:
            n = min(sh.hi, producer.hi) - max(sh.lo, producer.lo)
            if n > 0:
                yield sh, n * per_sample * producer.frac_out * sh.frac_in

    # ---- events ----------------------------------------------------------------------
    def push(self, t: float, kind: str, data) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, data))

    def transfer(self, t: float, a: str, b: str, nbytes: float, op, kind: str, stage: int, micro: int) -> None:
        if a == b or nbytes <= 0:
            self.push(t, "arrive", op)
            return
        start = max(t, self.up_free[a], self.down_free[b])
        end = start + self.cluster.transfer_time(a, b, nbytes)
        for d in (a, b):
            dev = self.cluster.device(d)
            self.debt[d] += nbytes * dev.comm_s_per_byte + dev.msg_s
        self.up_free[a] = self.down_free[b] = end
        self.events.append(Event(a, kind, stage, micro, start, end, peer=b, nbytes=nbytes))
        self.push(end, "arrive", op)

    def set_ready(self, op, t: float) -> None:
        self.ready[op] = t
        self.to_dispatch.update(self.op_devices(op))

    def run(self) -> Timeline:
        self.build()
        while self.heap or self.to_dispatch:
            if self.to_dispatch:
                t = self.now
                for d in sorted(self.to_dispatch, key=self.cluster.index):
                    self.dispatch(d, t)
                self.to_dispatch.clear()
                continue
            t = self.heap[0][0]
            self.now = t
            while self.heap and self.heap[0][0] <= t + EPS:
                _, _, kind, data = heapq.heappop(self.heap)
                getattr(self, f"on_{kind}")(data, t)
        self.check_finished()
        return self.timeline()

    now = 0.0

    def on_arrive(self, op, t: float) -> None:
        self.deps[op] -= 1
        if self.deps[op] == 0:
            self.set_ready(op, t)

    def on_done(self, op, t: float) -> None:
        kind, p, m, dev = op
        self.t_end = max(self.t_end, t)
        for d in self.op_devices(op):
            self.busy[d] = False
            self.to_dispatch.add(d)
        if kind == "U":
            return
        w = self.works[p]
        shares = [s for s in w.shares[m] if dev is None or s.device == dev]
        if kind == "F" and p == self.P - 1:
            self.on_arrive(self.op_key("B", p, m, dev), t)
        if kind == "F" and p < self.P - 1:
            nxt = self.works[p + 1]
            for cons in nxt.shares[m]:
                for prod, nbytes in self._links(p, m, cons):
                    if prod in shares:
                        self.transfer(t, prod.device, cons.device, nbytes, self.op_key("F", p + 1, m, cons.device),
                                      "send", p, m)
        if kind == "B":
            if p > 0:
                prev = self.works[p - 1]
                for prod in prev.shares[m]:
                    for cons, nbytes in self._links_back(p - 1, m, prod):
                        if cons in shares:
                            self.transfer(t, cons.device, prod.device, nbytes,
                                          self.op_key("B", p - 1, m, prod.device), "send", p, m)
            self.b_left[p] -= 1
            self.last_b_end[p] = max(self.last_b_end[p], t)
            if self.b_left[p] == 0:
                end = t + w.allreduce
                if w.allreduce > 0:
                    for d in w.devices:
                        self.events.append(Event(d, "allreduce", p, None, t, end))
                self.push(end, "reduced", p)

    def on_reduced(self, p: int, t: float) -> None:
        self.t_end = max(self.t_end, t)
        self.reduced_left -= 1
        if self.reduced_left == 0:
            self.push(t + 2 * self.cluster.latency, "commit", None)

    def on_commit(self, _, t: float) -> None:
        self.t_end = max(self.t_end, t)
        for p, w in enumerate(self.works):
            for d in w.devices:
                self.on_arrive(("U", p, None, d), t)

    def dispatch(self, d: str, t: float) -> None:
        if self.busy[d] or self.waiting[d] is not None:
            return
        best = None
        for p, q in self.queues[d]:
            if q and q[0] in self.ready:
                op = q[0]
                rank = (self.ready[op], -p, 0 if op[0] == "B" else 1)
                if best is None or rank < best[0]:
                    best = (rank, p, q)
        if best is None:
            return
        _, p, q = best
        op = q.popleft()
        if op[3] is None:  # a gang: wait for the whole group
            self.waiting[d] = op
            self.joined[op].add(d)
            if len(self.joined[op]) == len(self.works[p].devices):
                for g in self.works[p].devices:
                    self.waiting[g] = None
                self.start(op, t)
        else:
            self.start(op, t)

    def start(self, op, t: float) -> None:
        kind, p, m, dev = op
        w = self.works[p]
        end = t
        for d in self.op_devices(op):
            self.busy[d] = True
            if kind == "U":
                dur = w.update[d]
            else:
                dur = (w.fwd if kind == "F" else w.bwd)[m].get(d, 0.0)
            # the CPU its transfers took since its last computation, less what fitted while it was idle
            dur += max(0.0, self.debt.pop(d, 0.0) - max(0.0, t - self.free_at[d]))
            self.events.append(Event(d, kind if kind != "U" else "update", p, m, t, t + dur))
            self.free_at[d] = t + dur
            end = max(end, t + dur)
        self.push(end, "done", op)

    def check_finished(self) -> None:
        left = {d: [q[0] for _, q in qs if q] for d, qs in self.queues.items()}
        stuck = {d: ops for d, ops in left.items() if ops}
        if stuck:
            d, ops = next(iter(stuck.items()))
            kind, p, m, _ = ops[0]
            raise PlanError(f"the schedule cannot finish: device {d} waits forever for {kind}{m} of stage {p} "
                            "(a device serving several stages in an order that deadlocks)")

    # ---- results ---------------------------------------------------------------------
    def timeline(self) -> Timeline:
        peak, eq3, busy = self.memory(), self.eq3(), defaultdict(float)
        for e in self.events:
            if e.kind in ("F", "B", "update"):
                busy[e.device] += e.end - e.start
        settled = max([self.t_end] + [e.end for e in self.events]
                      + [self.free_at[d] + debt for d, debt in self.debt.items()])
        budgets = {d: self._budget(d) for d in peak}
        step = self.overlapped(settled)
        self.events.sort(key=lambda e: (e.start, e.device))
        return Timeline(self.events, step, self.plan.batch_size, peak, eq3, budgets, dict(busy), self.works,
                        settled_s=settled, gates=self.gates, commit=self.commit)

    def overlapped(self, settled: float) -> float:
        """The step time once each step runs over the step before's sums, as the workers do
        (swarm/execution/worker.py, Tail): a device reports the step ready after its last
        backward and the commit comes back while the sums travel; each bucket's update is
        applied once its sum and the commit are in, and the next forward waits layer by
        layer for its own layers' updates (DeviceWorker.gate_hook). The sums start bucket by
        bucket during the last backward, in the stage's sum_order (bucket_sums); what is left
        of them and of the updates hides behind the next step's forward up to where it
        reaches each bucket's lowest layer (gate_wait). The step is then the latest of: the
        commit; each stage's gates; and each device's CPU (its computations, its share of
        the gradient sums' work, and whatever its transfers took that idle time did not
        cover). A stage that sums nothing updates all at once after the commit, before its
        first forward's end. A device with a tiles stage ends every step settled, and so
        does this."""
        if any(w.stage.mode == "tiles" for w in self.works):
            return settled
        computed = [e for e in self.events if e.kind in ("F", "B")]
        if not computed:
            return settled
        self.commit = max(e.end for e in computed) + 2 * self.cluster.latency
        cpu: dict[str, float] = defaultdict(float, self.debt)
        for e in self.events:
            if e.kind in ("F", "B", "update"):
                cpu[e.device] += e.end - e.start
            if e.kind == "F" and e.start < getattr(self.first_forward.get((e.stage, e.device)), "start", float("inf")):
                self.first_forward[(e.stage, e.device)] = e
        for w in self.works:  # the sums' own time on each device comes out of the same CPU
            for d, seconds in w.reduce_cpu.items():
                cpu[d] += seconds
        step = max(self.commit, *cpu.values())
        for p, w in enumerate(self.works):
            sums = self.bucket_sums(p)
            if sums is None:
                for d in w.devices:
                    forward = self.first_forward.get((p, d))
                    step = max(step, self.commit + w.update[d] - (forward.end if forward else 0.0))
                continue
            tops = [b[0] for b in sums[0]]
            self.gates[p] = (*sums, self.gate_ahead(p, sums[0]))
            order = [tops.index(top) for top in sum_sequence(tops, w.stage.sum_order)]
            _, final, seconds, ahead = self.gates[p]
            step = max(step, gate_wait(final, seconds, ahead, self.commit, order))
        return min(step, settled)

    def bucket_sums(self, p: int) -> tuple[list[list[int]], list[float], list[float]] | None:
        """Stage p's gradient buckets (buckets_of, top layers' first), when each is final and
        how long its sum takes, as the workers sum them (swarm.execution.reduce): a bucket is
        final once the stage's last backward has passed its lowest layer, the last backward's
        time spread over its layers as its device's costs spread a backward, and its sum takes
        the group's sum time in proportion to its bytes. None where the stage sums nothing."""
        w = self.works[p]
        end = self.last_b_end[p]
        if w.allreduce <= 0:
            return None
        first, last = w.stage.first, w.stage.last
        sizes = {i: int(self.mem.param_bytes[i]) for i in range(first, last) if self.mem.param_bytes[i] > 0}
        ends = [e for e in self.events if e.kind == "B" and e.stage == p and e.end >= end - EPS]
        if not sizes:
            return None
        buckets = buckets_of(sizes)
        held = sum(sizes.values())
        seconds = [w.allreduce * sum(sizes[i] for i in bucket) / held for bucket in buckets]
        if not ends:
            return buckets, [end] * len(buckets), seconds
        start = max(e.start for e in ends)
        layer_s = self.cluster.device(ends[0].device).costs.bwd[first:last, 0]
        behind = np.cumsum(layer_s[::-1])[::-1] / max(float(layer_s.sum()), EPS)  # done once layer first + k is
        return buckets, [start + (end - start) * float(behind[min(b) - first]) for b in buckets], seconds

    def gate_ahead(self, p: int, buckets: list[list[int]]) -> list[tuple[list[float], list[float]]]:
        """For each device of stage p, per bucket: its update's seconds (the device's update by
        the bucket's bytes) and how far into the next step the device's forward reaches the
        bucket's lowest layer (its first forward's start, and that forward's time spread over
        its layers as the device's costs spread a forward)."""
        w = self.works[p]
        first, last = w.stage.first, w.stage.last
        nbytes = [float(sum(self.mem.param_bytes[i] for i in b)) for b in buckets]
        shares = [b / max(sum(nbytes), EPS) for b in nbytes]
        out = []
        for d in w.devices:
            forward = self.first_forward.get((p, d))
            layer_s = self.cluster.device(d).costs.fwd[first:last, 0]
            before = np.concatenate([[0.0], np.cumsum(layer_s)]) / max(float(layer_s.sum()), EPS)
            update = [w.update[d] * share for share in shares]
            if forward is None:
                reach = [0.0] * len(buckets)
            else:
                reach = [forward.start + (forward.end - forward.start) * float(before[min(b) - first]) for b in buckets]
            out.append((update, reach))
        return out

    def _budget(self, device: str) -> float:
        """The device's memory for its stages (MemoryModel.budget: more for the whole model
        alone; not for tiles, whose memory the tiles' own model counts)."""
        stages = [s for s in self.plan.stages if device in s.devices]
        memory = self.cluster.device(device).memory
        if len(stages) == 1 and stages[0].mode != "tiles":
            return self.mem.budget(stages[0].first, stages[0].last, memory)
        return memory

    def memory(self) -> dict[str, float]:
        """Peak bytes per device: weights of all its stages, activations live between each
        micro-batch's forward and backward, and the backward's transient buffers."""
        static = defaultdict(float)
        for w in self.works:
            for d, b in w.weights.items():
                static[d] += b
        if self.mem.kept:  # each device's snapshots and backups, charged once for the device (kept_charge)
            for d, kept in kept_states(self.plan, self.mem).items():
                if d in static:
                    charged = sum(self.mem.kept_charge(self.mem.state(s.first, s.last))
                                  for s in self.plan.stages if d in s.devices)
                    static[d] += self.mem.kept_charge(kept) - charged
        changes = defaultdict(list)
        for e in self.events:
            if e.kind not in ("F", "B"):
                continue
            w = self.works[e.stage]
            act = w.act[e.micro].get(e.device, 0.0)
            if e.kind == "F":
                changes[e.device].append((e.start, 1, act, 0.0))
            else:
                changes[e.device].append((e.start, 0, 0.0, w.transient[e.micro].get(e.device, 0.0)))
                changes[e.device].append((e.end, -1, -act, 0.0))
        peak = {}
        for d in static:
            live = top = 0.0
            for _, _, delta, transient in sorted(changes[d], key=lambda c: (c[0], c[1])):
                live += delta
                top = max(top, live + transient)
            peak[d] = static[d] + top
        return peak

    def eq3(self) -> dict[str, float]:
        warm = self.plan.warmups()
        out = defaultdict(float)
        for p, w in enumerate(self.works):
            k = min(warm[p], self.M)
            for d in w.devices:
                act = max(a.get(d, 0.0) for a in w.act)
                tr = max(x.get(d, 0.0) for x in w.transient)
                out[d] += w.weights[d] + k * act + tr
        return dict(out)
