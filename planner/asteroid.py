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

The DP runs over (head devices, sub-pipeline devices) blocks with numpy arrays over all
(first layer, cut) pairs at once. For deep models, stages start and end at no more than
MAX_CUTS candidate boundaries: the cumulative compute is split into that many equal
parts and each part offers its boundary with the smallest activation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.allocation import memory_aware_allocation
from planner.asteroid_tables import AsteroidTables
from planner.inputs import NoPlan, PlanInputs
from planner.plan import Plan, Stage
from planner.simulator import Timeline
from planner.units import format_bytes


MAX_CUTS = 64  # candidate stage boundaries for deep models (every boundary when there are fewer)
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
                 cap: int | None = None):
        self.inputs = inputs
        self.cap = cap  # the most forwards any stage warms up with (None: Asteroid's K)
        cl = inputs.cluster
        self.order = sorted(cl.names, key=lambda n: (-cl.device(n).memory, cl.reference_time(n, inputs.microbatch),
                                                    cl.index(n)))
        self.cuts = candidate_cuts(inputs, max_cuts, start)  # the pipeline covers layers [start, L)
        self.N, self.M, self.B = len(self.order), inputs.microbatches, inputs.microbatch
        self.L = len(self.cuts) - 1  # the DP's "layers" are the spans between candidate cuts
        self.P = min(self.N, self.L, max_stages or self.N)
        self.t = AsteroidTables(inputs, self.order, self.cuts)
        self._group_cache: dict = {}
        self._prep_links()

    # ---- costs of blocks -------------------------------------------------------------
    def _prep_links(self) -> None:
        cl, N = self.inputs.cluster, self.N
        idx = [cl.index(n) for n in self.order]
        bw = cl.bandwidth[np.ix_(idx, idx)]
        self.bwb_f = np.full((N + 1, N + 1, N + 1), np.inf)  # head block [a, c) -> next block [c, e)
        self.bwb_b = np.full((N + 1, N + 1, N + 1), np.inf)
        for a in range(N):
            for c in range(a + 1, N):
                for e in range(c + 1, N + 1):
                    streams = min(c - a, e - c)
                    self.bwb_f[a, c, e] = streams * bw[a:c, c:e].min()
                    self.bwb_b[a, c, e] = streams * bw[c:e, a:c].min()
        mem = self.inputs.mem
        self.bnd = np.array([mem.boundary(int(b)) for b in self.cuts]) * self.B

    def block(self, a: int, c: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(E_f, E_b, T_a) of group [a, c) for every range, as (L + 1) x (L + 1) arrays (inf: cannot run)."""
        key = (a, c, K)
        if key in self._group_cache:
            return self._group_cache[key]
        L, t, cl = self.L, self.t, self.inputs.cluster
        group = list(range(a, c))
        ef, eb = t.stage(group, K)
        names = self.order[a:c]
        g = c - a
        extra = np.zeros(len(t.valid))
        ta = np.zeros(len(t.valid))
        if g > 1:
            minbw = cl.min_bw(names)
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

    def warmup(self, p: int) -> int:
        """K of the head of a p-stage pipeline: Asteroid's 2p - 1, at most M and the cap."""
        return min(2 * p - 1, self.M, self.cap or self.M)

    # ---- the dynamic program ---------------------------------------------------------
    def solve(self) -> list[Pipeline]:
        """The best pipeline for each number of stages (those that exist)."""
        L, N, M, P = self.L, self.N, self.M, self.P
        inf = np.inf
        # per level: D, A, end (first group's end device), choice; [slot] 0 = lowest D + A, 1 = lowest D
        D = np.full((P + 1, 2, L + 1, N + 1), inf)
        A = np.full((P + 1, 2, L + 1, N + 1), inf)
        END = np.zeros((P + 1, 2, L + 1, N + 1), dtype=np.int64)
        CHOICE = np.zeros((P + 1, 2, L + 1, N + 1, 3), dtype=np.int64)  # (c, j, slot of the sub-pipeline)
        K1 = min(1, M)
        for a in range(N):
            for e in range(a + 1, N + 1):
                ef, eb, ta = self.block(a, e, K1)
                d_new = M * (ef[:, L] + eb[:, L])
                a_new = ta[:, L]
                self._keep(D[1], A[1], END[1], CHOICE[1], a, d_new, a_new, e, np.full(L + 1, L), 0)
        for p in range(2, P + 1):
            K = self.warmup(p)
            for a in range(N - p + 1):
                for c in range(a + 1, N - p + 2):
                    ef, eb, ta = self.block(a, c, K)
                    ene = ef + eb
                    for slot in (0, 1):
                        d_old, a_old = D[p - 1, slot, :, c], A[p - 1, slot, :, c]
                        ends = END[p - 1, slot, :, c]
                        ok = np.isfinite(d_old)
                        if not ok.any():
                            continue
                        e_idx = np.where(ok, ends, c + 1)
                        with np.errstate(divide="ignore", invalid="ignore"):
                            tf = np.where(ok, self.inputs.cluster.latency + self.bnd / self.bwb_f[a, c, e_idx], inf)
                            tb = np.where(ok, self.inputs.cluster.latency + self.bnd / self.bwb_b[a, c, e_idx], inf)
                            enc = tf + tb
                            d_new = np.maximum(np.maximum(M * ene, ene + M * enc[None, :]), ene + enc[None, :] + d_old[None, :])
                            a_new = np.maximum(ta, a_old[None, :] - eb - tb[None, :])
                            total = d_new + a_new
                        bad = ~np.isfinite(total) | ~ok[None, :]
                        total = np.where(bad, inf, total)
                        d_masked = np.where(bad, inf, d_new)
                        j_best = np.argmin(total, axis=1)
                        j_lowd = np.argmin(d_masked, axis=1)
                        rows = np.arange(L + 1)
                        for j_sel in (j_best, j_lowd):
                            dn = d_masked[rows, j_sel]
                            an = np.where(np.isfinite(dn), a_new[rows, j_sel], inf)
                            self._keep(D[p], A[p], END[p], CHOICE[p], a, dn, an, c, j_sel, slot)
        pipelines = []
        for p in range(1, P + 1):
            for slot in (0, 1):
                if np.isfinite(D[p, slot, 0, 0]):
                    pipelines.append(self._rebuild(D, A, END, CHOICE, p, slot))
        return pipelines

    @staticmethod
    def _keep(D, A, END, CHOICE, a, d_new, a_new, end, j, sub_slot) -> None:
        """Fold candidates (one per first layer i) into state (i, a): slot 0 by D + A, slot 1 by D."""
        total = d_new + a_new
        better0 = total < D[0, :, a] + A[0, :, a]
        better1 = (d_new < D[1, :, a]) | ((d_new == D[1, :, a]) & (total < D[1, :, a] + A[1, :, a]))
        for slot, better in ((0, better0), (1, better1)):
            D[slot, better, a] = d_new[better]
            A[slot, better, a] = a_new[better]
            END[slot, better, a] = end
            CHOICE[slot, better, a, 0] = end
            CHOICE[slot, better, a, 1] = j[better] if np.ndim(j) else j
            CHOICE[slot, better, a, 2] = sub_slot

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


def plan_asteroid(inputs: PlanInputs, max_stages: int | None = None) -> Plan:
    """Asteroid's best pipeline; where none fits with Asteroid's warm-ups, the fastest that
    fits with fewer micro-batches in flight (WARMUP_CAPS)."""
    if inputs.batch_size % inputs.microbatches:
        raise NoPlan(f"Asteroid splits micro-batches inside groups: the batch ({inputs.batch_size}) must split "
                     f"evenly into {inputs.microbatches} micro-batches")
    found, shortfall = [], None
    for cap in (None, *(k for k in WARMUP_CAPS if k < inputs.microbatches)):
        dp = AsteroidDP(inputs, max_stages, cap=cap)
        pipelines = dp.solve()
        if not pipelines:
            shortfall = shortfall or memory_shortfall(inputs, dp)
            continue
        found.append((_fastest(inputs, dp, pipelines), pipelines))
        if found[-1][0][1].fits:
            break
    if not found:
        raise NoPlan(shortfall)
    (plan, timeline), pipelines = found[-1] if found[-1][0][1].fits else found[0]
    plan.predicted = timeline.summary()
    plan.predicted["asteroid_estimate_s"] = min(p.estimate for p in pipelines)
    return inputs.with_overlap(plan)


def _fastest(inputs: PlanInputs, dp: AsteroidDP, pipelines: list[Pipeline]) -> tuple[Plan, Timeline]:
    """Of the DP's best estimates, the plan the simulator finds fastest among those that fit
    (the best estimate where none does)."""
    best = None
    for pipe in sorted(pipelines, key=lambda q: q.estimate)[:SIMULATED_CANDIDATES]:
        plan = pipeline_plan(inputs, dp, pipe)
        timeline = inputs.simulate(plan)
        key = timeline.step_time if timeline.fits else float("inf")
        if best is None or key < best[0]:
            best = (key, plan, timeline)
    return best[1], best[2]


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
