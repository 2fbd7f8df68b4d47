"""Asteroid (Ye et al., section 3.3): hybrid pipeline parallelism by dynamic programming.

Devices are sorted by memory, largest first (early stages keep the most activations), and
a stage runs on a block of consecutive devices of that order with Alg. 1's allocation.
Q(l, n, p) is the best pipeline of p stages over the last l layers and the last n devices;
a new head stage (layers L-l .. L-l', devices N-n .. N-n') joins the best sub-pipeline
Q(l', n', p - 1) through a communication step (eqs. 10, 11). The head warms up with
K = 2p - 1 micro-batches and must fit every device's budget (eq. 3, a hard constraint).

The round latency (eqs. 4-6) of steps s = 0..S-1 (execution and communication steps
alternating, E^s = E_f^s + E_b^s, T_a^s the all-reduce) comes out as D + A with
    D = max_s (M E^s + sum_{i<s} E^i)           the dominant step, aligned (eq. 11)
    A = max_s (T_a^s - sum_{i<s} E_b^i)          the all-reduces after the backward drain
and both extend to a new head h = (execution ne, communication nc) in closed form:
    D' = max(M E^ne, E^ne + M E^nc, E^ne + E^nc + D)
    A' = max(T_a^ne, A - E_b^ne - E_b^nc).
Alg. 2 keeps one sub-pipeline per state (the lowest latency); since D + A is not
monotone in a single number, each state here also keeps its lowest-D sub-pipeline, and
every extension tries both. The last stage may leave the slowest-memory devices unused.
Candidates (the best pipelines for each stage count, the eight with the lowest estimates)
are then simulated and the fastest that fits is the plan.

The DP runs, for each stage count and head group size, over every head start and all
(first layer, cut) pairs at once in numpy arrays. A group's costs depend on its devices'
classes (planner/classes.py) and its slowest link, so they are worked out once per class
make-up (the first group with it stands for the others), every make-up of one size in one
vectorised Alg. 1. Past EVERY_BLOCK_UP_TO devices a group has at most one device more than
a micro-batch has samples. Given a step to beat (auto's best so far), a stage whose group
cannot compute it in less is left out (AsteroidTables.worth). For deep models, stages
start and end at no more than MAX_CUTS candidate boundaries: the cumulative compute is
split into that many equal parts and each part offers its boundary with the smallest
activation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.allocation import memory_aware_allocation
from planner.asteroid_tables import AsteroidTables
from planner.bounds import compute_floor
from planner.classes import device_classes
from planner.inputs import NoPlan, PlanInputs
from planner.plan import Plan, Stage
from planner.simulator import Timeline
from planner.units import format_bytes


MAX_CUTS = 64  # candidate stage boundaries for deep models (every boundary when there are fewer)
# Up to this many devices the DP tries every block of the sorted devices, as Asteroid's does
# (a block's idle members let a pipeline leave devices out). Beyond it a group has at most
# one device more than a micro-batch has samples: the rest would idle, and one idle member
# is enough for a stage to leave a device of its class out and the next start on the next.
EVERY_BLOCK_UP_TO = 16
SIMULATED_CANDIDATES = 8  # the DP's best pipelines that are simulated to pick the plan
# Where no pipeline fits with Asteroid's warm-ups (K = 2p - 1: a first stage of eight holds
# fifteen micro-batches' activations, or all of them), pipelines whose stages warm up with
# at most this many forwards, the largest first: fewer micro-batches in flight, for a
# longer fill and drain (one: each micro-batch through every stage and back before the next).
WARMUP_CAPS = (4, 2, 1)


@dataclass
class Pipeline:
    stages: list[tuple[int, int, int, int]]  # (first layer, last layer, first device, end device) in sorted order
    estimate: float  # D + A, seconds per step


class AsteroidDP:
    def __init__(self, inputs: PlanInputs, max_stages: int | None = None, max_cuts: int = MAX_CUTS, start: int = 0,
                 cap: int | None = None, bound: float | None = None):
        self.inputs = inputs
        self.cap = cap  # the most forwards any stage warms up with (None: Asteroid's K)
        cl = inputs.cluster
        kinds = device_classes(cl)
        first = {n: cl.names[kinds[cl.index(n)]] for n in cl.names}  # each device's class, by its first device
        self.order = sorted(cl.names, key=lambda n: (-cl.device(first[n]).memory,
                                                    cl.reference_time(first[n], inputs.microbatch),
                                                    cl.index(first[n]), cl.index(n)))
        self.kind = [cl.index(first[n]) for n in self.order]
        self.cuts = candidate_cuts(inputs, max_cuts, start)  # the pipeline covers layers [start, L)
        self.N, self.M, self.B = len(self.order), inputs.microbatches, inputs.microbatch
        self.G = self.N if self.N <= EVERY_BLOCK_UP_TO else min(self.N, self.B + 1)  # the most devices in a group
        self.L = len(self.cuts) - 1  # the DP's "layers" are the spans between candidate cuts
        self.P = min(self.N, self.L, max_stages or self.N)
        self.t = AsteroidTables(inputs, self.order, self.cuts, bound)  # bound: the step to beat, if any
        self._group_cache: dict = {}
        self._min_bw: dict = {}  # (a, c) -> the slowest link within group [a, c)
        self._first_group: dict = {}  # class make-up -> the first group (positions) with it
        self._stacks: dict = {}
        self.blocks_costed = 0  # groups whose stage costs were worked out (the rest are their class's)
        self._prep_links()

    # ---- costs of blocks -------------------------------------------------------------
    def _prep_links(self) -> None:
        """The rates between a head group [a, a + w) and the next group [a + w, a + w + v): as
        many streams as the smaller group has devices, each at the slowest pair's rate."""
        cl, N, G = self.inputs.cluster, self.N, self.G
        idx = [cl.index(n) for n in self.order]
        bw = cl.bandwidth[np.ix_(idx, idx)]
        self.bwb_f = np.full((N + 1, G + 1, G + 1), np.inf)  # [a, w, v]
        self.bwb_b = np.full((N + 1, G + 1, G + 1), np.inf)
        for a in range(N):
            for w in range(1, min(G, N - 1 - a) + 1):
                c = a + w
                for v in range(1, min(G, N - c) + 1):
                    streams = min(w, v)
                    self.bwb_f[a, w, v] = streams * bw[a:c, c:c + v].min()
                    self.bwb_b[a, w, v] = streams * bw[c:c + v, a:c].min()
        mem = self.inputs.mem
        self.bnd = np.array([mem.boundary(int(b)) for b in self.cuts]) * self.B

    def block(self, a: int, c: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(E_f, E_b, T_a) of group [a, c) for every range, as (L + 1) x (L + 1) arrays (inf: cannot run).
        Worked out once per class make-up and slowest link (module docstring)."""
        cl = self.inputs.cluster
        g = c - a
        if (a, c) not in self._min_bw:
            self._min_bw[(a, c)] = cl.min_bw(self.order[a:c])
        minbw = self._min_bw[(a, c)]
        makeup = tuple(self.kind[a:c])
        key = (makeup, minbw, K)
        if key in self._group_cache:
            return self._group_cache[key]
        L, t = self.L, self.t
        group = self._first_group.setdefault(makeup, list(range(a, c)))
        self.blocks_costed += 1
        ef, eb = t.stage(group, K)
        extra = np.zeros(len(t.valid))
        ta = np.zeros(len(t.valid))
        if g > 1:
            desc = self.inputs.desc
            per_layer = np.array([(cl.latency + (g - 1) * (8 + 16 * layer.out_shape[0]) / minbw)
                                  if layer.batch_normalize else 0.0 for layer in desc.layers])
            cum = np.concatenate([[0.0], np.cumsum(per_layer)])
            extra = cum[t.vj] - cum[t.vi]  # BatchNorm statistics, per micro-batch and direction
            ta = 2 * (g - 1) * cl.latency + 2 * (g - 1) / g * t.param_bytes / minbw  # eq. 5
        out = []
        for arr in (ef + extra, eb + extra, ta):
            full = np.full((L + 1) * (L + 1), np.inf)
            full[t.valid] = arr
            out.append(full.reshape(L + 1, L + 1))
        self._group_cache[key] = tuple(out)
        return self._group_cache[key]

    def blocks(self, w: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """block(a, a + w, K) for every a = 0 .. N - w, stacked: three (N - w + 1, L + 1, L + 1) arrays."""
        key = (w, K)
        if key not in self._stacks:
            starts = range(self.N - w + 1)
            self.t.stages([self._first_group.setdefault(tuple(self.kind[a:a + w]), list(range(a, a + w)))
                           for a in starts], K)  # every make-up's stage costs at once
            parts = [self.block(a, a + w, K) for a in starts]
            self._stacks[key] = tuple(np.stack([p[k] for p in parts]) for k in range(3))
        return self._stacks[key]

    def _forget_below(self, K: int) -> None:
        """Drop the blocks of warm-ups under K, which no later level uses (a deep model's
        blocks over many devices take hundreds of MiB)."""
        self._stacks = {key: v for key, v in self._stacks.items() if key[1] >= K}
        self._group_cache = {key: v for key, v in self._group_cache.items() if key[2] >= K}

    def warmup(self, p: int) -> int:
        """K of the head of a p-stage pipeline: Asteroid's 2p - 1, at most M and the cap."""
        return min(2 * p - 1, self.M, self.cap or self.M)

    # ---- the dynamic program ---------------------------------------------------------
    def solve(self) -> list[Pipeline]:
        """The best pipeline for each number of stages (those that exist). Each level runs, for
        each head group size w, over every head start a at once; states fold their candidates
        in the order of Alg. 2's loops (a, then the head's end, then the sub-pipeline's slot)."""
        L, N, M, P, G = self.L, self.N, self.M, self.P, self.G
        inf = np.inf
        # per level: D, A, end (first group's end device), choice; [slot] 0 = lowest D + A, 1 = lowest D
        D = np.full((P + 1, 2, L + 1, N + 1), inf)
        A = np.full((P + 1, 2, L + 1, N + 1), inf)
        END = np.zeros((P + 1, 2, L + 1, N + 1), dtype=np.int64)
        CHOICE = np.zeros((P + 1, 2, L + 1, N + 1, 3), dtype=np.int64)  # (c, j, slot of the sub-pipeline)
        K1 = min(1, M)
        for w in range(1, G + 1):
            heads = np.arange(N - w + 1)
            ef, eb, ta = self.blocks(w, K1)
            d_new = (M * (ef[:, :, L] + eb[:, :, L])).T  # (first layer, head start)
            a_new = ta[:, :, L].T
            self._keep(D[1], A[1], END[1], CHOICE[1], heads, d_new, a_new, heads + w,
                       np.full(d_new.shape, L), 0)
        lat = self.inputs.cluster.latency
        for p in range(2, P + 1):
            K = self.warmup(p)
            self._forget_below(K)  # warm-ups only grow with the level
            for w in range(1, G + 1):
                heads = np.arange(max(0, N - p + 2 - w))  # a head [a, a + w) leaves p - 1 devices at least
                if heads.size == 0:
                    continue
                c = heads + w
                ef, eb, ta = (x[heads] for x in self.blocks(w, K))
                ene = ef + eb  # (head, i, j)
                for slot in (0, 1):
                    d_old, a_old = D[p - 1, slot][:, c].T, A[p - 1, slot][:, c].T  # (head, j)
                    ok = np.isfinite(d_old)
                    if not ok.any():
                        continue
                    v = np.where(ok, END[p - 1, slot][:, c].T - c[:, None], 1)  # the next group's size
                    with np.errstate(divide="ignore", invalid="ignore"):
                        tf = np.where(ok, lat + self.bnd[None, :] / self.bwb_f[heads[:, None], w, v], inf)
                        tb = np.where(ok, lat + self.bnd[None, :] / self.bwb_b[heads[:, None], w, v], inf)
                        enc = (tf + tb)[:, None, :]
                        d_new = np.maximum(np.maximum(M * ene, ene + M * enc), ene + enc + d_old[:, None, :])
                        a_new = np.maximum(ta, a_old[:, None, :] - eb - tb[:, None, :])
                        total = d_new + a_new
                    bad = ~np.isfinite(total) | ~ok[:, None, :]
                    total = np.where(bad, inf, total)
                    d_masked = np.where(bad, inf, d_new)
                    for j_sel in (np.argmin(total, axis=2), np.argmin(d_masked, axis=2)):  # (head, i)
                        dn = np.take_along_axis(d_masked, j_sel[:, :, None], axis=2)[:, :, 0]
                        an = np.take_along_axis(a_new, j_sel[:, :, None], axis=2)[:, :, 0]
                        an = np.where(np.isfinite(dn), an, inf)
                        self._keep(D[p], A[p], END[p], CHOICE[p], heads, dn.T, an.T, c, j_sel.T, slot)
        pipelines = []
        for p in range(1, P + 1):
            for slot in (0, 1):
                if np.isfinite(D[p, slot, 0, 0]):
                    pipelines.append(self._rebuild(D, A, END, CHOICE, p, slot))
        return pipelines

    @staticmethod
    def _keep(D, A, END, CHOICE, heads, d_new, a_new, end, j, sub_slot) -> None:
        """Fold candidates (first layer i, head start a) into states (i, a): slot 0 by D + A,
        slot 1 by D. d_new, a_new, j: (L + 1, len(heads)); end: per head."""
        total = d_new + a_new
        ends = np.broadcast_to(end, d_new.shape)
        d_old, a_old = D[:, :, heads], A[:, :, heads]
        better = (total < d_old[0] + a_old[0],
                  (d_new < d_old[1]) | ((d_new == d_old[1]) & (total < d_old[1] + a_old[1])))
        for slot in (0, 1):
            keep = better[slot]
            D[slot][:, heads] = np.where(keep, d_new, d_old[slot])
            A[slot][:, heads] = np.where(keep, a_new, a_old[slot])
            END[slot][:, heads] = np.where(keep, ends, END[slot][:, heads])
            for k, value in enumerate((ends, j, sub_slot)):
                CHOICE[slot][:, heads, k] = np.where(keep, value, CHOICE[slot][:, heads, k])

    def _rebuild(self, D, A, END, CHOICE, p: int, slot: int) -> Pipeline:
        stages = []
        i, a = 0, 0
        estimate = float(D[p, slot, 0, 0] + A[p, slot, 0, 0])
        for level in range(p, 0, -1):
            c, j, sub = (int(x) for x in CHOICE[level, slot, i, a])
            stages.append((int(self.cuts[i]), int(self.cuts[j]), a, c))
            i, a, slot = j, c, sub
        return Pipeline(stages, estimate)


def pipeline_estimate(inputs: PlanInputs, order: list[str], stages: list[tuple[int, int, int, int]]) -> float:
    """D + A of one pipeline, step by step with the scalar Alg. 1 (the reference the DP must
    match). stages: (first layer, last layer, first device, end device) in `order`."""
    cl, mem, M, B = inputs.cluster, inputs.mem, inputs.microbatches, inputs.microbatch
    P, L = len(stages), inputs.num_layers
    steps = []  # (E_f, E_b, T_a)
    for p, (first, last, a, c) in enumerate(stages):
        names = order[a:c]
        K = min(2 * (P - p) - 1, M)
        with_loss = last == L
        budgets = [cl.device(n).memory for n in names]
        if any(mem.weights(first, last) > u for u in budgets):
            return float("inf")
        alloc = memory_aware_allocation(
            names, B, lambda d, y: cl.device(d).costs.range_time(first, last, y, with_loss) if y else 0.0,
            lambda d: mem.max_batch(first, last, K, cl.device(d).memory), block=max(1, B // 16))
        if alloc is None:
            return float("inf")
        ef = eb = 0.0
        for d, y in alloc.items():
            if y:
                costs = cl.device(d).costs
                f, b = costs.fwd_range(first, last, y), costs.bwd_range(first, last, y)
                if with_loss:
                    lf, lb = costs.loss_time(y)
                    f, b = f + lf, b + lb
                ef, eb = max(ef, f), max(eb, b)
        g = len(names)
        ta = 0.0
        if g > 1:
            minbw = cl.min_bw(names)
            bn = sum(cl.latency + (g - 1) * (8 + 16 * layer.out_shape[0]) / minbw
                     for layer in inputs.desc.layers[first:last] if layer.batch_normalize)
            ef, eb = ef + bn, eb + bn
            ta = 2 * (g - 1) * cl.latency + 2 * (g - 1) / g * float(mem.param_bytes[first:last].sum()) / minbw
        steps.append((ef, eb, ta))
        if p + 1 < P:
            nxt = stages[p + 1]
            head, tail = order[a:c], order[nxt[2]:nxt[3]]
            streams = min(len(head), len(tail))
            nbytes = B * mem.boundary(last)
            fwd_bw = streams * min(cl.bw(x, y) for x in head for y in tail)
            bwd_bw = streams * min(cl.bw(y, x) for x in head for y in tail)
            steps.append((cl.latency + nbytes / fwd_bw, cl.latency + nbytes / bwd_bw, 0.0))
    D = max(M * (f + b) + sum(x[0] + x[1] for x in steps[:s]) for s, (f, b, _) in enumerate(steps))
    A = max(ta - sum(x[1] for x in steps[:s]) for s, (_, _, ta) in enumerate(steps))
    return D + A


def candidate_cuts(inputs: PlanInputs, limit: int, start: int = 0) -> list[int]:
    """Every layer boundary from `start` on, or for deep models about `limit` of them (module docstring)."""
    L = inputs.num_layers
    if L + 1 - start <= limit:
        return list(range(start, L + 1))
    ref = inputs.cluster.devices[0].costs
    work = np.array([ref.range_time(i, i + 1, inputs.microbatch) for i in range(start, L)])
    cum = np.concatenate([[0.0], np.cumsum(work)])
    parts = limit - 1
    inner = len(work)  # boundaries start+1 .. L-1 are cum[1:inner]
    window = np.minimum((cum[1:inner] / max(cum[inner], 1e-30) * parts).astype(int), parts - 1)
    cuts = {start, L}
    for k in np.unique(window):
        members = np.flatnonzero(window == k) + 1 + start
        centre = members[len(members) // 2]
        cuts.add(int(min(members, key=lambda b: (inputs.mem.boundary(int(b)), abs(int(b) - int(centre))))))
    return sorted(cuts)


def pipeline_plan(inputs: PlanInputs, dp: AsteroidDP, pipe: Pipeline) -> Plan:
    stages = []
    P = len(pipe.stages)
    for p, (first, last, a, c) in enumerate(pipe.stages):
        names = dp.order[a:c]
        if len(names) == 1:
            stages.append(Stage(first, last, "single", names))
            continue
        K = dp.warmup(P - p)
        alloc = dp.t.allocation_of(list(range(a, c)), K, first, last)
        alloc = {d: y for d, y in (alloc or {}).items() if y > 0}
        if len(alloc) == 1:
            stages.append(Stage(first, last, "single", list(alloc)))
        else:
            stages.append(Stage(first, last, "dp", list(alloc), allocation=alloc))
    if dp.cap is not None:
        for p, stage in enumerate(stages):
            stage.warmup = dp.warmup(P - p)
    return inputs.plan(stages, "asteroid")


def plan_asteroid(inputs: PlanInputs, max_stages: int | None = None, bound: float | None = None) -> Plan | None:
    """Asteroid's best pipeline; where none fits with Asteroid's warm-ups, the fastest that
    fits with fewer micro-batches in flight (WARMUP_CAPS). With `bound` (auto's best step so
    far), None where no pipeline could beat it (planner/bounds.py)."""
    if inputs.batch_size % inputs.microbatches:
        raise NoPlan(f"Asteroid splits micro-batches inside groups: the batch ({inputs.batch_size}) must split "
                     f"evenly into {inputs.microbatches} micro-batches")
    found, shortfall = [], None
    for cap in (None, *(k for k in WARMUP_CAPS if k < inputs.microbatches)):
        dp = AsteroidDP(inputs, max_stages, cap=cap, bound=bound)
        pipelines = dp.solve()
        if not pipelines:
            if bound is None:
                shortfall = shortfall or memory_shortfall(inputs, dp)
            continue
        best, fits = _fastest(inputs, dp, pipelines, bound)
        if best is not None:
            found.append((best, pipelines))
        if fits:
            break
    if not found:
        if bound is not None:
            return None
        raise NoPlan(shortfall)
    (plan, timeline), pipelines = found[-1] if found[-1][0][1].fits else found[0]
    plan.predicted = timeline.summary()
    plan.predicted["asteroid_estimate_s"] = min(p.estimate for p in pipelines)
    return inputs.with_overlap(inputs.with_sum_orders(plan, timeline))


def _fastest(inputs: PlanInputs, dp: AsteroidDP, pipelines: list[Pipeline], bound: float | None = None
             ) -> tuple[tuple[Plan, Timeline] | None, bool]:
    """Of the DP's best estimates, the plan the simulator finds fastest among those that fit
    (the best estimate where none does), and whether any fits. They are simulated in the
    order of their compute floors (planner/bounds.py), and those whose floor cannot beat the
    fastest so far, or `bound`, are not; with `bound`, the plan is None where none could beat
    it, and whether one fits is still found out (it decides whether warm-ups are capped)."""
    plans = [pipeline_plan(inputs, dp, pipe) for pipe in sorted(pipelines, key=lambda q: q.estimate)
             [:SIMULATED_CANDIDATES]]
    floors = [compute_floor(plan, inputs) for plan in plans]
    timelines: dict[int, Timeline] = {}
    best = None  # (step, k), of a plan that fits
    for k in sorted(range(len(plans)), key=lambda k: floors[k]):
        if (bound is not None and floors[k] >= bound) or (best is not None and floors[k] >= best[0]):
            break
        timelines[k] = inputs.simulate(plans[k])
        if timelines[k].fits and (best is None or (timelines[k].step_time, k) < best):
            best = (timelines[k].step_time, k)
    if best is not None:
        return (plans[best[1]], timelines[best[1]]), True
    unsimulated = [k for k in range(len(plans)) if k not in timelines]
    if not unsimulated:  # none fits: the best estimate
        return (plans[0], timelines[0]), False
    for k in unsimulated:  # none could beat the bound; would one fit?
        if inputs.simulate(plans[k]).fits:
            return None, True
    return None, False


def memory_shortfall(inputs: PlanInputs, dp: AsteroidDP) -> str:
    """Why nothing fits: the stage that needs least memory still overflows somewhere."""
    mem = inputs.mem
    worst = None
    for layer in range(inputs.num_layers):
        need = mem.stage(layer, layer + 1, 1, 1)
        if worst is None or need > worst[0]:
            worst = (need, layer)
    biggest = max(inputs.cluster.devices, key=lambda d: d.memory)
    need, layer = worst
    return (f"no pipeline fits in memory: layer {layer} alone needs {format_bytes(need)} for one sample "
            f"(weights, gradients, optimizer state and activations); the largest device, {biggest.name}, "
            f"has {format_bytes(biggest.memory)}")
