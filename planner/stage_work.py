"""What one stage of a plan asks of each of its devices: samples, seconds, bytes.

The simulator turns these into a timeline; the planners use the same numbers, so a
planner's estimate and the simulator's prediction come from one cost model.

- single: one device, the whole micro-batch.
- dp: the micro-batch's samples are dealt out in the order of the stage's `devices` (the
  first gets samples [0, y_a) by its `allocation`, the next the following y_b, ...). With BatchNorm the group
  exchanges per-channel sums at every BN layer, forward and backward, so its devices move
  in step: the stage is a gang whose duration is, per BN segment, the slowest device.
- tiles: every device works on its tiles of every sample (planner/tiles_work.py, which
  builds on the shares, works and collective times here).
The simulator's `stage_works` picks by each stage's mode. After the last backward, groups
of two or more all-reduce their weight gradients (ring, Asteroid eq. 5), then every device
applies the optimizer to the stage's layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import permutations

from planner.buckets import buckets_of
from planner.cluster import Cluster
from planner.memory import MemoryModel
from planner.model_desc import ModelDesc
from planner.plan import PlanError, Stage
from planner.schedule import overlap_units, stage_schedule

IMAGE_BYTES_PER_VALUE = 1  # samples travel as uint8 images


def microbatch_sizes(batch: int, microbatches: int) -> list[int]:
    """Sizes of the micro-batches of a mini-batch: consecutive ranges differing by at most one
    (the trainer's split)."""
    base, extra = divmod(batch, microbatches)
    return [base + (1 if m < extra else 0) for m in range(microbatches)]


DIRECT_REDUCE_MAX = 8  # groups up to this size all-reduce straight to each chunk's owner and back


def allreduce_rounds(g: int) -> int:
    """Rounds of swarm's all-reduce over g members (swarm.execution.collectives), each a
    wait for the round before: 2 straight to each chunk's owner and back (up to
    DIRECT_REDUCE_MAX members), 2 log2(g) halving and doubling (larger powers of two),
    else 2(g-1) round a ring."""
    if g < 2:
        return 0
    if g <= DIRECT_REDUCE_MAX:
        return 2
    return 2 * (g.bit_length() - 1) if g & (g - 1) == 0 else 2 * (g - 1)


def allreduce_messages(g: int) -> int:
    """Messages out (and as many in) per member of swarm's all-reduce over g members: 2(g-1),
    or 2 log2(g) halving and doubling."""
    if g < 2:
        return 0
    if g > DIRECT_REDUCE_MAX and g & (g - 1) == 0:
        return 2 * (g.bit_length() - 1)
    return 2 * (g - 1)


def ring_allreduce_time(nbytes: float, group: list[str], cluster: Cluster, buckets: int = 1,
                        weights: dict[str, int] | None = None) -> float:
    """Asteroid eq. 5: 2(g-1)/g of the data over the slowest link, plus a message latency per
    round (allreduce_rounds). Each device sends and receives that much at once: the sum runs
    no faster than a device's CPU moves twice the bytes. The data goes in `buckets` sums
    (one per bucket of layers, started as the backward finishes each): their latencies
    overlap, but every member handles each of its messages out and in (allreduce_messages),
    each a message's handling and the sum's own work on it (Cluster.reduce_msg_cpu). A
    member computing on an accelerator copies its gradients to the host and the sums back:
    twice the bytes at the slowest member's copy rate. Groups that sum on lanes of their own
    (_lane_cost) move their bytes and shares at the lanes' measured costs instead, with no
    reduce_msg_s: the event loop's per-message work is not on a lane. Summing straight with
    chunks owned by `weights` (Stage.sum_weights), each member's bytes (_moved) take it their
    time at its own cost, and the slowest member sets the pace."""
    g = len(group)
    if g < 2 or nbytes <= 0:
        return 0.0
    lane = _lane_cost(group, cluster)
    message = lane[1] if lane else cluster.reduce_msg_cpu(group)
    link = 1 / cluster.min_bw(group)
    messages = max(1, buckets) * allreduce_messages(g) * 2 * message
    copies = 2 * nbytes * cluster.copy_per_byte(group)
    moved = _moved(nbytes, group, weights)  # out, and half of it in at once
    cpu = {d: cluster.device(d).lane_s_per_byte if lane else cluster.device(d).comm_s_per_byte for d in group}
    bytes_s = max(moved[d] / 2 * max(link, 2 * cpu[d]) for d in group)
    return allreduce_rounds(g) * cluster.latency + messages + bytes_s + copies


def _moved(nbytes: float, group: list[str], weights: dict[str, int] | None) -> dict[str, float]:
    """The bytes each member sends and receives in all in a sum of `nbytes`: 4(g-1)/g of them with
    equal chunks; summing straight with chunks c_j by `weights` (swarm.execution.collectives.
    chunk_bounds), 2(nbytes - c_j) + 2(g-1)c_j. Other ways (larger groups) move equal parts."""
    g = len(group)
    if not weights or g > DIRECT_REDUCE_MAX or not all(d in weights for d in group) \
            or len({weights[d] for d in group}) == 1:
        return {d: 2 * 2 * (g - 1) / g * nbytes for d in group}
    total = sum(weights[d] for d in group)
    return {d: 2 * nbytes + 2 * (g - 2) * nbytes * weights[d] / total for d in group}


def allreduce_cpu(nbytes: float, group: list[str], cluster: Cluster, buckets: int = 1,
                  weights: dict[str, int] | None = None) -> dict[str, float]:
    """Each member's own time on a sum of `nbytes` in `buckets` sums: the 2(g-1)/g of the
    bytes it sends and as many it receives, at its comm_s_per_byte, and its messages out and
    in (allreduce_messages, per bucket), at its msg_s + reduce_msg_s. ring_allreduce_time
    takes the slowest member's for the sum's wall time; this is what the sum takes from each
    member's CPU, where its computation also runs (under a CPU quota, the same quota); on
    lanes (_lane_cost), at lane_s_per_byte and lane_msg_s. With `weights`, each member moves
    what its chunk makes it (_moved)."""
    g = len(group)
    if g < 2 or nbytes <= 0:
        return {}
    moved = _moved(nbytes, group, weights)
    messages = max(1, buckets) * allreduce_messages(g) * 2
    if _lane_cost(group, cluster):
        return {d: moved[d] * cluster.device(d).lane_s_per_byte + messages * cluster.device(d).lane_msg_s
                for d in group}
    return {d: moved[d] * cluster.device(d).comm_s_per_byte
            + messages * (cluster.device(d).msg_s + cluster.device(d).reduce_msg_s) for d in group}


def _lane_cost(group: list[str], cluster: Cluster) -> tuple[float, float] | None:
    """(seconds per byte, per share) of a sum over `group` on lanes of its own (swarm.execution.
    lane: groups of up to DIRECT_REDUCE_MAX, where every member's lanes were measured), else None."""
    return cluster.lane_cpu(group) if len(group) <= DIRECT_REDUCE_MAX else None


DIRECT_GATHER_MAX = 4  # groups up to this size all-gather in one round, each member to every other


def allgather_time(nbytes: float, group: list[str], cluster: Cluster) -> float:
    """swarm.execution.collectives.allgather: a group of up to DIRECT_GATHER_MAX members in
    one round of g-1 messages out and in per member, a larger one by Bruck's algorithm in
    ceil(log2 g) rounds of one message out and one in (and a latency each); every member's
    `nbytes` reach the g-1 others once."""
    g = len(group)
    if g < 2:
        return 0.0
    rounds = 1 if g <= DIRECT_GATHER_MAX else (g - 1).bit_length()
    per_byte = max(1 / cluster.min_bw(group), 2 * cluster.comm_cpu(group))
    return rounds * cluster.latency + 2 * _gather_messages(g) * cluster.msg_cpu(group) + (g - 1) * nbytes * per_byte


def _gather_messages(g: int) -> int:
    """Messages out (and as many in) per member of an all-gather over g members."""
    return g - 1 if g <= DIRECT_GATHER_MAX else (g - 1).bit_length()


def allgather_cpu(nbytes: float, group: list[str], cluster: Cluster) -> float:
    """What of allgather_time is each member's own CPU: its messages' handling and, where its
    CPU is slower than the link, moving the bytes. Other work beside the gather hides the rest
    (the latencies, a link's time), not this: under a CPU quota it takes from the same share."""
    g = len(group)
    if g < 2:
        return 0.0
    return 2 * _gather_messages(g) * cluster.msg_cpu(group) + (g - 1) * nbytes * 2 * cluster.comm_cpu(group)


SUM_ORDER_TRIALS = 7  # up to this many buckets every order is tried (7! = 5040)


def gate_wait(final: list[float], seconds: list[float], ahead: list[tuple[list[float], list[float]]],
              commit: float, order: list[int]) -> float:
    """How long after a step's start the next step may start for one stage's gates. Bucket k
    is final at final[k] and its sum takes seconds[k] on a lane that sums one bucket at a
    time, in `order`; its update follows its sum and the step's commit. For each device,
    ahead holds per bucket what its update takes and how far into the next step's forward
    the device reaches the bucket's lowest layer (simulator._Run.gate_ahead): the forward
    starts late by whatever bucket would not be in before it is reached."""
    t, worst = 0.0, 0.0
    for k in order:
        t = max(t, final[k]) + seconds[k]
        for update, reach in ahead:
            worst = max(worst, max(t, commit) + update[k] - reach[k])
    return worst


def best_sum_order(buckets: list[list[int]], final: list[float], seconds: list[float], commit: float,
                   ahead: list[tuple[list[float], list[float]]]) -> list[int]:
    """The order of a stage's bucket sums (buckets top layer first, as buckets_of gives them;
    the rest as gate_wait takes them) that lets the next step's forward start soonest. Every
    order is tried up to SUM_ORDER_TRIALS buckets; beyond, top layer first with the largest
    sums moved to the end one by one, the best of those. Returns the buckets' top layers in
    the order found: top layer first unless another order is faster by more than a
    millisecond."""
    plain = list(range(len(buckets)))
    best, best_wait = plain, gate_wait(final, seconds, ahead, commit, plain)
    if len(buckets) <= SUM_ORDER_TRIALS:
        candidates = permutations(plain)
    else:
        candidates, order = [], plain
        for k in sorted(plain, key=lambda k: -seconds[k]):
            order = [j for j in order if j != k] + [k]
            candidates.append(order)
    for order in candidates:
        wait = gate_wait(final, seconds, ahead, commit, order)
        if wait < best_wait - 1e-3:
            best, best_wait = list(order), wait
    return [buckets[k][0] for k in best]


def gradient_buckets(mem: MemoryModel, first: int, last: int) -> int:
    """The rings a group's gradients of layers [first, last) take."""
    return len(buckets_of({i: int(mem.param_bytes[i]) for i in range(first, last) if mem.param_bytes[i] > 0}))


# What a BatchNorm exchange of a gang inside a pipeline costs each member beyond its messages,
# in messages' time (msg_s). On the testbed (8 x 0.2 core, resnet18 at 224, pairs of devices
# splitting the micro-batches of its first two stages, 2026-11-30 22:49 UTC) an exchange took
# 16.2-17.2 ms (exchange_s over a step's 80 and 96 exchanges) where its messages give 4.1
# (latency 0.33 ms, msg_s 1.75-1.90 ms): 12-13 ms more, about seven messages' time, and the
# plan ran 58% under its prediction without it. A one-stage dp group needs none: yolov2-16's
# four pairs at 416 (2026-12-01 00:41 UTC) waited 21-31 ms an exchange, most of it for the
# partner's long layers, which the model's slowest-member rule counts, and ran within 1% of
# their prediction without it (7% under with it). What a pipeline adds is not measured apart;
# the members of a gang inside one take their inputs from the stage before, a member at a time.
EXCHANGE_MESSAGES = 7


def bn_sync_time(desc: ModelDesc, first: int, last: int, group: list[str], cluster: Cluster,
                 in_pipeline: bool = False) -> float:
    """Per micro-batch and direction: the BatchNorm statistics a split stage gathers at every
    BN layer (a count and two float64 values per channel from each member), and inside a
    pipeline each exchange's EXCHANGE_MESSAGES more."""
    if len(group) < 2:
        return 0.0
    extra = EXCHANGE_MESSAGES * cluster.msg_cpu(group) if in_pipeline else 0.0
    return sum(allgather_time(8 + 16 * layer.out_shape[0], group, cluster) + extra
               for layer in desc.layers[first:last] if layer.batch_normalize)


def bn_sync_cpu(desc: ModelDesc, first: int, last: int, group: list[str], cluster: Cluster,
                in_pipeline: bool = False) -> float:
    """What of bn_sync_time is each member's own CPU (allgather_cpu, and EXCHANGE_MESSAGES)."""
    if len(group) < 2:
        return 0.0
    extra = EXCHANGE_MESSAGES * cluster.msg_cpu(group) if in_pipeline else 0.0
    return sum(allgather_cpu(8 + 16 * layer.out_shape[0], group, cluster) + extra
               for layer in desc.layers[first:last] if layer.batch_normalize)


@dataclass
class Share:
    """One device's part of one micro-batch in a stage."""

    device: str
    lo: int  # samples [lo, hi) of the micro-batch
    hi: int
    frac_in: float = 1.0  # share of each sample's input map it needs (tiles: its tiles plus halo)
    frac_out: float = 1.0  # share of each sample's output map it produces

    @property
    def samples(self) -> int:
        return self.hi - self.lo


@dataclass
class StageWork:
    index: int
    stage: Stage
    gang: bool  # devices start and end each micro-batch together
    shares: list[list[Share]]  # per micro-batch
    fwd: list[dict[str, float]]  # per micro-batch: device -> seconds
    bwd: list[dict[str, float]]
    act: list[dict[str, float]]  # bytes held from a micro-batch's forward to its backward
    transient: list[dict[str, float]]  # extra bytes during its backward
    weights: dict[str, float]  # parameters, gradients, optimizer state
    allreduce: float  # seconds, once per mini-batch
    update: dict[str, float]  # optimizer step, once per mini-batch
    reduce_cpu: dict[str, float] = field(default_factory=dict)  # each device's own time on the sum (allreduce_cpu)
    sync_fwd: float = 0.0  # seconds of the fwd/bwd times spent in group syncs (for pictures)
    sync_bwd: float = 0.0
    detail: dict = field(default_factory=dict)  # mode-specific facts (tiles: grid, halo bytes)

    @property
    def devices(self) -> list[str]:
        return self.stage.devices


def split_stage_work(p: int, stage: Stage, desc: ModelDesc, mem: MemoryModel, cluster: Cluster,
                     sizes: list[int], is_last: bool, warmup: int = 1, in_pipeline: bool = False) -> StageWork:
    """The work of a single or dp stage: whole samples per device (`warmup`: its K_p, for a
    stage that overlaps; `in_pipeline`: the plan has other stages)."""
    first, last = stage.first, stage.last
    if stage.mode == "single":
        alloc = None
    else:
        alloc = dict(stage.allocation or {})
        if any(sizes[0] != s for s in sizes):
            raise PlanError(f"stage {p}: a dp stage needs micro-batches of one size, got {sizes}")
    group = list(stage.devices)
    bn_layers = [i for i in range(first, last) if desc.layers[i].batch_normalize]
    # a replicated stage: each micro-batch runs on its replica alone, whole on each (a pipeline
    # of such stages is costed where every replica is one device)
    runs_on = [stage.replica_devices(r) for r in stage.replica_order(len(sizes))]
    if stage.replica_count() > 1 and max(len(g) for g in runs_on) > 1:
        raise PlanError(f"stage {p}: replicas of dp groups of several devices are costed only in a one-stage plan")
    gang = alloc is not None and len(group) > 1 and bool(bn_layers) and stage.replica_count() == 1
    sync = bn_sync_time(desc, first, last, group, cluster, in_pipeline) if gang else 0.0
    shares, fwd, bwd, act, trans = [], [], [], [], []
    for m, size in enumerate(sizes):
        if alloc is None or stage.replica_count() > 1:
            sh = [Share(runs_on[m][0], 0, size)]
        else:
            sh, lo = [], 0
            for d in group:
                sh.append(Share(d, lo, lo + alloc[d]))
                lo += alloc[d]
        f, b = {}, {}
        for s in sh:
            costs = cluster.device(s.device).costs
            f[s.device] = costs.fwd_range(first, last, s.samples)
            b[s.device] = costs.bwd_range(first, last, s.samples)
            if is_last and s.samples:
                lf, lb = costs.loss_time(s.samples)
                f[s.device] += lf
                b[s.device] += lb
        if gang:
            f = _gang_time(sh, cluster, first, last, bn_layers, "fwd", is_last) + sync
            b = _gang_time(sh, cluster, first, last, bn_layers, "bwd", is_last) + sync
            f, b = {d: f for d in group}, {d: b for d in group}
        shares.append(sh)
        fwd.append(f)
        bwd.append(b)
        act.append({s.device: mem.activations(first, last, s.samples) for s in sh})
        trans.append({s.device: mem.transient(first, last, s.samples) for s in sh})
    if gang and stage.overlap:
        _overlap(fwd, bwd, act, trans, sync, warmup, bn_sync_cpu(desc, first, last, group, cluster, in_pipeline))
    weights = {d: mem.weights(first, last) for d in group}
    reduce_bytes = float(mem.param_bytes[first:last].sum())
    allreduce, own = 0.0, {}
    if len(group) > 1:  # (the buckets are worth finding only for a group: planners ask this often)
        buckets = gradient_buckets(mem, first, last)
        weighed = stage.sum_weights(len(sizes))
        allreduce = ring_allreduce_time(reduce_bytes, group, cluster, buckets, weighed)
        own = allreduce_cpu(reduce_bytes, group, cluster, buckets, weighed)
    update = {d: cluster.device(d).costs.update_range(first, last) for d in group}
    return StageWork(p, stage, gang, shares, fwd, bwd, act, trans, weights, allreduce, update,
                     own, sync if gang else 0.0, sync if gang else 0.0)


# What a paired op's compute costs beside the other, against alone: two micro-batches' working
# sets taking turns on one core's caches, and a hand-over of the compute lock at every
# BatchNorm exchange. On the testbed (8 x 0.2 core, yolov2-16 at 416, two replicas of four
# devices with one sample each, bench/versus.py --runs plan, two rounds) a device's CPU a step
# rose from 2.77-2.80 s to 2.99-3.07 s with 6 of its 8 ops paired: 16% of their compute. The
# waits it hid were mostly not idle time (a 0.2-core device was busy 92% of its step without
# it), so the step took 7-8% longer.
OVERLAP_CPU = 1.16


def _overlap(fwd: list[dict], bwd: list[dict], act: list[dict], trans: list[dict], sync: float, warmup: int,
             sync_cpu: float = 0.0) -> None:
    """A gang that runs each backward beside the next forward (Stage.overlap), in place: in
    each pair, what one waits for its group's sums the other computes, so each keeps only the
    part of its sync the other's work does not cover, at OVERLAP_CPU times the compute; the
    sync's own CPU (`sync_cpu`: its messages' handling) is work, which nothing beside it
    hides; and the backward's transient memory holds the forward's activations as they build up."""
    wait = max(0.0, sync - sync_cpu)
    for unit in overlap_units(stage_schedule(len(fwd), warmup)):
        if len(unit) < 2:
            continue
        (_, j), (_, i) = unit  # B j beside F i
        for d in bwd[j]:
            back = (bwd[j][d] - sync) * OVERLAP_CPU + sync_cpu
            fore = (fwd[i][d] - sync) * OVERLAP_CPU + sync_cpu
            bwd[j][d] = back + max(0.0, wait - fore)
            fwd[i][d] = fore + max(0.0, wait - back)
            trans[j][d] = trans[j].get(d, 0.0) + act[i].get(d, 0.0)


def group_microbatch_time(desc: ModelDesc, cluster: Cluster, allocation: dict[str, int], first: int, last: int,
                          is_last: bool) -> float:
    """One micro-batch's forward and backward through layers [first, last) on a group splitting
    it by `allocation` (one device: its own time), as split_stage_work costs a lock-step group:
    per stretch between BatchNorm layers its slowest member, and the BatchNorm exchanges."""
    shares, lo = [], 0
    for d, y in allocation.items():
        shares.append(Share(d, lo, lo + y))
        lo += y
    if len(shares) == 1:
        return cluster.device(shares[0].device).costs.range_time(first, last, lo, is_last)
    bn_layers = [i for i in range(first, last) if desc.layers[i].batch_normalize]
    sync = bn_sync_time(desc, first, last, list(allocation), cluster) if bn_layers else 0.0
    return sum(_gang_time(shares, cluster, first, last, bn_layers, kind, is_last) + sync for kind in ("fwd", "bwd"))


def _gang_time(shares: list[Share], cluster: Cluster, first: int, last: int, bn_layers: list[int],
               kind: str, is_last: bool) -> float:
    """A lock-step group's time: per segment between BN syncs, its slowest device."""
    cuts = [first] + [i + 1 for i in bn_layers if i + 1 < last] + [last]
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        slowest = 0.0
        for s in shares:
            costs = cluster.device(s.device).costs
            t = costs.fwd_range(a, b, s.samples) if kind == "fwd" else costs.bwd_range(a, b, s.samples)
            if is_last and b == last and s.samples:
                lf, lb = costs.loss_time(s.samples)
                t += lf if kind == "fwd" else lb
            slowest = max(slowest, t)
        total += slowest
    return total
