"""HierTrain (Liu et al., sections IV-V): tasks O, S and L over a device/edge/cloud hierarchy.

worker_o trains the whole model on b_o samples, worker_s layers 1..m_s on b_s samples,
worker_l layers 1..m_l on b_l samples; outputs of S and L go to O, which finishes their
samples. Algorithm 1: for each of the six mappings of three devices onto (o, s, l) and every
0 <= m_s <= m_l <= N (for deep models, m_s and m_l among Asteroid's candidate cuts),
solve the relaxed LP of P1 (eqs. 5-19, the max terms as epigraph
variables) for b_o, b_s, b_l, round as the paper does (the largest fractional parts go up
until the sum is B), evaluate T_total (eq. 12) and keep the best. Each LP has two free
variables, so its optimum is found among the vertices of its pieces, for every pair at once
(solve_mapping_arrays; the tests check it against scipy's HiGHS on the same LPs).

Its timing model is HierTrain's: linear in the number of samples (per-sample layer times
taken at the micro-batch size), with no pipelining. As a Plan, the result is
    [0, m_s)    dp over (o, s, l) with allocation (b_o, b_s, b_l)
    [m_s, m_l)  dp over (o, l)    with (b_o + b_s, b_l)
    [m_l, N)    single on o
(empty ranges and devices with no samples left out), simulated like any other plan.

Which three devices: one per tier when devices carry "tier" (device, edge, cloud — the
fastest of each); otherwise the data source and the two fastest other devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from planner.asteroid import MAX_CUTS, candidate_cuts
from planner.inputs import NoPlan, PlanInputs
from planner.plan import Plan, Stage
from planner.stage_work import IMAGE_BYTES_PER_VALUE

ROLES = ("o", "s", "l")


@dataclass
class Schedule:
    mapping: dict[str, str | None]  # role -> device
    m_s: int
    m_l: int
    b: dict[str, int]  # role -> samples
    total: float  # T_total, eq. 12


def choose_workers(inputs: PlanInputs) -> list[str]:
    cl = inputs.cluster
    fastest = cl.by_speed(inputs.microbatch)
    tiers = {}
    for name in fastest:
        tier = cl.device(name).tier
        if tier in ("device", "edge", "cloud") and tier not in tiers:
            tiers[tier] = name
    if len(tiers) == 3:
        return [tiers["device"], tiers["edge"], tiers["cloud"]]
    chosen = [cl.data_source] if cl.data_source else []
    chosen += [n for n in fastest if n not in chosen]
    return chosen[:3]


class HierTrainModel:
    """The per-sample quantities of eqs. 1-11 for one mapping of devices onto roles."""

    def __init__(self, inputs: PlanInputs, mapping: dict[str, str | None]):
        cl, mem, L = inputs.cluster, inputs.mem, inputs.num_layers
        self.L, self.B = L, inputs.microbatch
        self.mapping = mapping
        data = cl.data_source or next(d for d in mapping.values() if d)
        image = inputs.desc.input_bytes // 4 * IMAGE_BYTES_PER_VALUE
        self.f, self.b, self.cum_f, self.cum_b, self.upd, self.t_in = {}, {}, {}, {}, {}, {}
        for role, dev in mapping.items():
            if dev is None:
                continue
            costs = cl.device(dev).costs.per_sample(self.B)
            f = costs.fwd[:, 0].copy()
            b = costs.bwd[:, 0].copy()
            f[-1] += costs.loss_fwd[0]
            b[-1] += costs.loss_bwd[0]
            self.cum_f[role] = np.concatenate([[0.0], np.cumsum(f)])
            self.cum_b[role] = np.concatenate([[0.0], np.cumsum(b)])
            self.upd[role] = np.concatenate([[0.0], np.cumsum(costs.update)])
            self.t_in[role] = 0.0 if dev == data else image / cl.bw(data, dev)
        o = mapping["o"]
        self.mo = np.array([mem.boundary(k) for k in range(L + 1)])  # MO at boundary k (output of layer k)
        self.bw = {r: (cl.bw(mapping[r], o) if mapping[r] else np.inf) for r in ("s", "l")}
        self.latency = cl.latency
        self.mp = np.concatenate([[0.0], np.cumsum(mem.param_bytes)])

    def fsum(self, role, a, b):
        return self.cum_f[role][b] - self.cum_f[role][a]

    def bsum(self, role, a, b):
        return self.cum_b[role][b] - self.cum_b[role][a]

    def coefficients(self, ms: int, ml: int) -> dict:
        """Per-sample coefficients of each term of eqs. 5-10 for partition points (m_s, m_l)."""
        L = self.L
        has_s, has_l = "s" in self.cum_f and ms > 0, "l" in self.cum_f and ml > 0
        out_s = self.mo[ms] / self.bw["s"] if has_s else 0.0
        out_l = self.mo[ml] / self.bw["l"] if has_l else 0.0
        c = {
            "f1": [self.t_in["o"] + self.fsum("o", 0, ms),
                   (self.t_in["s"] + self.fsum("s", 0, ms) + out_s) if has_s else 0.0,
                   (self.t_in["l"] + self.fsum("l", 0, ms)) if has_l else 0.0],
            "b1": [self.bsum("o", 0, ms),
                   (self.bsum("s", 0, ms) + out_s) if has_s else 0.0,
                   self.bsum("l", 0, ms) if has_l else 0.0],
            "f2": [self.fsum("o", ms, ml), (self.fsum("l", ms, ml) + out_l) if has_l else 0.0],
            "b2": [self.bsum("o", ms, ml), (self.bsum("l", ms, ml) + out_l) if has_l else 0.0],
            "f3": self.fsum("o", ml, L), "b3": self.bsum("o", ml, L),
            "has_s": has_s, "has_l": has_l,
        }
        upd = [self.upd["o"][L], self.upd["s"][ms] if has_s else 0.0, self.upd["l"][ml] if has_l else 0.0]
        wg_s = 2 * self.mp[ms] / self.bw["s"] + 2 * self.latency if has_s else 0.0
        wg_l = 2 * self.mp[ml] / self.bw["l"] + 2 * self.latency if has_l else 0.0
        c["update"] = max(upd) + max(wg_s, wg_l)  # eq. 11
        return c

    def coefficient_arrays(self, ms: np.ndarray, ml: np.ndarray) -> dict:
        """coefficients() for many (m_s, m_l) at once: every entry an array over the pairs."""
        zero = np.zeros(len(ms))
        has_s = (ms > 0) & ("s" in self.cum_f)
        has_l = (ml > 0) & ("l" in self.cum_f)

        def cum(table, role, idx):
            return table[role][idx] if role in table else zero

        out_s = np.where(has_s, self.mo[ms] / self.bw["s"], 0.0)
        out_l = np.where(has_l, self.mo[ml] / self.bw["l"], 0.0)
        f, b = self.cum_f, self.cum_b
        L = self.L
        c = {
            "f1": [self.t_in["o"] + f["o"][ms] - f["o"][0],
                   np.where(has_s, self.t_in.get("s", 0.0) + cum(f, "s", ms) - cum(f, "s", 0) + out_s, 0.0),
                   np.where(has_l, self.t_in.get("l", 0.0) + cum(f, "l", ms) - cum(f, "l", 0), 0.0)],
            "b1": [b["o"][ms] - b["o"][0],
                   np.where(has_s, cum(b, "s", ms) - cum(b, "s", 0) + out_s, 0.0),
                   np.where(has_l, cum(b, "l", ms) - cum(b, "l", 0), 0.0)],
            "f2": [f["o"][ml] - f["o"][ms], np.where(has_l, cum(f, "l", ml) - cum(f, "l", ms) + out_l, 0.0)],
            "b2": [b["o"][ml] - b["o"][ms], np.where(has_l, cum(b, "l", ml) - cum(b, "l", ms) + out_l, 0.0)],
            "f3": f["o"][L] - f["o"][ml], "b3": b["o"][L] - b["o"][ml],
            "has_s": has_s, "has_l": has_l,
        }
        upd = np.maximum(np.maximum(self.upd["o"][L] + zero, np.where(has_s, cum(self.upd, "s", ms), 0.0)),
                         np.where(has_l, cum(self.upd, "l", ml), 0.0))
        wg_s = np.where(has_s, 2 * self.mp[ms] / self.bw["s"] + 2 * self.latency, 0.0)
        wg_l = np.where(has_l, 2 * self.mp[ml] / self.bw["l"] + 2 * self.latency, 0.0)
        c["update"] = upd + np.maximum(wg_s, wg_l)
        return c

    @staticmethod
    def totals(c: dict, bo: np.ndarray, bs: np.ndarray, bl: np.ndarray) -> np.ndarray:
        """total() over arrays of pairs and splits."""
        t1f = np.maximum(np.maximum(c["f1"][0] * bo, c["f1"][1] * bs), c["f1"][2] * bl)
        t1b = np.maximum(np.maximum(c["b1"][0] * bo, c["b1"][1] * bs), c["b1"][2] * bl)
        t2f = np.maximum(c["f2"][0] * (bo + bs), c["f2"][1] * bl)
        t2b = np.maximum(c["b2"][0] * (bo + bs), c["b2"][1] * bl)
        return t1f + t1b + t2f + t2b + (c["f3"] + c["b3"]) * (bo + bs + bl) + c["update"]

    def total(self, ms: int, ml: int, bo: float, bs: float, bl: float, c: dict | None = None) -> float:
        """T_total, eq. 12."""
        c = c or self.coefficients(ms, ml)
        t1f = max(c["f1"][0] * bo, c["f1"][1] * bs, c["f1"][2] * bl)
        t1b = max(c["b1"][0] * bo, c["b1"][1] * bs, c["b1"][2] * bl)
        t2f = max(c["f2"][0] * (bo + bs), c["f2"][1] * bl)
        t2b = max(c["b2"][0] * (bo + bs), c["b2"][1] * bl)
        B = bo + bs + bl
        return t1f + t1b + t2f + t2b + (c["f3"] + c["b3"]) * B + c["update"]


def round_samples(x: list[float], total: int) -> list[int]:
    """HierTrain's rounding: integer parts, then +1 for the largest fractional parts (one,
    then two) until the parts sum to `total`."""
    ints = [int(np.floor(v + 1e-9)) for v in x]
    fracs = [v - i for v, i in zip(x, ints)]
    order = sorted(range(len(x)), key=lambda k: -fracs[k])
    for extra in range(len(x) + 1):
        trial = [ints[k] + (1 if k in order[:extra] else 0) for k in range(len(x))]
        if sum(trial) == total:
            return trial
    trial = list(ints)  # only when the LP's sum is off by more than the paper's two steps
    trial[order[0]] += total - sum(trial)
    return trial


def round_splits(x: np.ndarray, total: int) -> np.ndarray:
    """round_samples for every row of x (n, 3) at once."""
    ints = np.floor(x + 1e-9).astype(np.int64)
    fracs = x - ints
    order = np.argsort(-fracs, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(3)[None, :].repeat(len(x), axis=0), axis=1)
    deficit = total - ints.sum(axis=1)
    ok = (deficit >= 0) & (deficit <= 3)
    out = ints + (ok[:, None] & (rank < deficit[:, None]))
    bad = np.flatnonzero(~ok)
    out[bad, order[bad, 0]] += total - out[bad].sum(axis=1)
    return out


def solve_mapping(model: HierTrainModel, pairs: list[tuple[int, int]]) -> list[tuple[float, float, float]]:
    """The relaxed LP of P1 for every (m_s, m_l) in `pairs`, as one block-diagonal LP.
    Block variables: b_o, b_s, b_l, t1f, t1b, t2f, t2b."""
    return [tuple(row) for row in solve_mapping_arrays(model, np.array([p[0] for p in pairs]),
                                                       np.array([p[1] for p in pairs]))[0]]


def solve_mapping_arrays(model: HierTrainModel, ms: np.ndarray, ml: np.ndarray) -> tuple[np.ndarray, dict]:
    """The relaxed LP of P1 for each pair (ms[i], ml[i]): rows (b_o, b_s, b_l), and the
    coefficients.

    Each pair's LP minimises t1f + t1b + t2f + t2b, the epigraphs of four maxima of linear
    functions of b, over the triangle b_o + b_s + b_l = B, b >= 0 (b_s = 0 without task S,
    b_l = 0 without L): a convex piecewise-linear function of two variables. Its minimum is
    at a vertex of the arrangement of the lines where a maximum changes its piece (two of
    its terms equal) and the triangle's edges: each vertex is where two of those planes
    through the origin meet the triangle, their normals' cross product scaled to sum B. All
    pairs' vertices are weighed at once (tests/test_planner_optimality.py checks the optimum
    against scipy's HiGHS on the same LP, solve_mapping_lp)."""
    c = model.coefficient_arrays(ms, ml)
    n = len(ms)
    f1, b1, f2, b2 = (np.broadcast_to(np.asarray(c[k], dtype=float), (len(c[k]), n)) for k in ("f1", "b1", "f2", "b2"))
    zero, one = np.zeros(n), np.ones(n)
    normals = []  # (n, 3) each: where two terms of one maximum are equal, then the triangle's edges
    for t in (f1, b1):
        normals += [np.stack([t[0], -t[1], zero], 1), np.stack([t[0], zero, -t[2]], 1), np.stack([zero, t[1], -t[2]], 1)]
    for t in (f2, b2):
        normals.append(np.stack([t[0], t[0], -t[1]], 1))
    normals += [np.stack([one, zero, zero], 1), np.stack([zero, one, zero], 1), np.stack([zero, zero, one], 1)]
    first, second = np.triu_indices(len(normals), 1)
    stacked = np.stack(normals, 1)  # (n, lines, 3)
    points = np.cross(stacked[:, first], stacked[:, second])  # (n, candidates, 3)
    sums = points.sum(axis=2)
    scale = np.abs(points).sum(axis=2)
    usable = np.abs(sums) > 1e-12 * np.maximum(scale, 1e-300)
    points = points * np.where(usable, model.B / np.where(usable, sums, 1.0), 0.0)[..., None]
    tol = 1e-9 * model.B
    usable &= (points >= -tol).all(axis=2)
    usable &= c["has_s"][:, None] | (points[..., 1] <= tol)
    usable &= c["has_l"][:, None] | (points[..., 2] <= tol)
    points = np.clip(points, 0.0, None)
    bo, bs, bl = points[..., 0], points[..., 1], points[..., 2]
    value = (np.maximum(np.maximum(f1[0][:, None] * bo, f1[1][:, None] * bs), f1[2][:, None] * bl)
             + np.maximum(np.maximum(b1[0][:, None] * bo, b1[1][:, None] * bs), b1[2][:, None] * bl)
             + np.maximum(f2[0][:, None] * (bo + bs), f2[1][:, None] * bl)
             + np.maximum(b2[0][:, None] * (bo + bs), b2[1][:, None] * bl))
    best = np.argmin(np.where(usable, value, np.inf), axis=1)  # (b_o = B alone is always a vertex)
    return points[np.arange(n), best], c


def solve_mapping_lp(model: HierTrainModel, ms: np.ndarray, ml: np.ndarray) -> np.ndarray:
    """The same LPs as solve_mapping_arrays, as one block-diagonal LP for scipy's HiGHS
    (block variables b_o, b_s, b_l, t1f, t1b, t2f, t2b): rows (b_o, b_s, b_l)."""
    n, nv = len(ms), 7
    c = model.coefficient_arrays(ms, ml)
    base = nv * np.arange(n)
    # the ten inequality rows of each block: (variable, coefficient) pairs, then the epigraph variable
    rows_spec = [([(0, c["f1"][0])], 3), ([(1, c["f1"][1])], 3), ([(2, c["f1"][2])], 3),
                 ([(0, c["b1"][0])], 4), ([(1, c["b1"][1])], 4), ([(2, c["b1"][2])], 4),
                 ([(0, c["f2"][0]), (1, c["f2"][0])], 5), ([(2, c["f2"][1])], 5),
                 ([(0, c["b2"][0]), (1, c["b2"][0])], 6), ([(2, c["b2"][1])], 6)]
    rows, cols, vals = [], [], []
    for r, (terms, t) in enumerate(rows_spec):
        row = 10 * np.arange(n) + r
        for var, coef in terms:
            rows.append(row)
            cols.append(base + var)
            vals.append(np.broadcast_to(coef, (n,)))
        rows.append(row)
        cols.append(base + t)
        vals.append(np.full(n, -1.0))
    a_ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(10 * n, nv * n))
    eq_rows = np.repeat(np.arange(n), 3)
    eq_cols = (base[:, None] + np.arange(3)[None, :]).ravel()
    a_eq = coo_matrix((np.ones(3 * n), (eq_rows, eq_cols)), shape=(n, nv * n))
    cost = np.tile(np.array([0, 0, 0, 1, 1, 1, 1], dtype=float), n)
    upper = np.full((n, nv), np.inf)
    upper[:, 1] = np.where(c["has_s"], np.inf, 0.0)  # eq. 18: b_s = 0 without task S
    upper[:, 2] = np.where(c["has_l"], np.inf, 0.0)  # eq. 19
    res = linprog(cost, A_ub=a_ub.tocsr(), b_ub=np.zeros(10 * n), A_eq=a_eq.tocsr(), b_eq=np.full(n, float(model.B)),
                  bounds=np.column_stack([np.zeros(nv * n), upper.ravel()]), method="highs-ds")
    if res.status != 0:
        raise NoPlan(f"HierTrain's LP failed: {res.message}")
    return res.x.reshape(n, nv)[:, :3]


def hiertrain_search(inputs: PlanInputs, workers: list[str]) -> Schedule:
    """Algorithm 1 over the given (up to three) devices."""
    cuts = np.array(candidate_cuts(inputs, MAX_CUTS))
    ms, ml = (a.ravel() for a in np.meshgrid(cuts, cuts, indexing="ij"))
    keep = ms <= ml
    ms, ml = ms[keep], ml[keep]
    best: Schedule | None = None
    padded = list(workers) + [None] * (3 - len(workers))
    seen = set()
    for perm in permutations(padded):
        if perm[0] is None or perm in seen:
            continue
        seen.add(perm)
        mapping = dict(zip(ROLES, perm))
        model = HierTrainModel(inputs, mapping)
        relaxed, c = solve_mapping_arrays(model, ms, ml)
        b = round_splits(relaxed, model.B)
        totals = model.totals(c, b[:, 0].astype(float), b[:, 1].astype(float), b[:, 2].astype(float))
        k = int(np.argmin(totals))
        if best is None or totals[k] < best.total - 1e-12:
            best = Schedule(mapping, int(ms[k]), int(ml[k]), {"o": int(b[k, 0]), "s": int(b[k, 1]), "l": int(b[k, 2])},
                            float(totals[k]))
    assert best is not None
    return best


def schedule_stages(s: Schedule, num_layers: int) -> list[Stage]:
    o, sdev, ldev = s.mapping["o"], s.mapping["s"], s.mapping["l"]
    b = s.b
    stages = []

    def add(first, last, alloc):
        alloc = {d: y for d, y in alloc if d is not None and y > 0}
        if last <= first:
            return
        if len(alloc) == 1:
            stages.append(Stage(first, last, "single", list(alloc)))
        else:
            stages.append(Stage(first, last, "dp", list(alloc), allocation=alloc))

    add(0, s.m_s, [(o, b["o"]), (sdev, b["s"]), (ldev, b["l"])])
    add(s.m_s, s.m_l, [(o, b["o"] + b["s"]), (ldev, b["l"])])
    add(s.m_l, num_layers, [(o, b["o"] + b["s"] + b["l"])])
    # neighbouring stages with the same single device are one stage
    merged: list[Stage] = []
    for st in stages:
        if merged and st.mode == "single" and merged[-1].mode == "single" and merged[-1].devices == st.devices:
            merged[-1] = Stage(merged[-1].first, st.last, "single", st.devices)
        else:
            merged.append(st)
    return merged


def plan_hiertrain(inputs: PlanInputs, workers: list[str] | None = None) -> Plan:
    if inputs.batch_size % inputs.microbatches:
        raise NoPlan(f"HierTrain splits micro-batches between workers: the batch ({inputs.batch_size}) must "
                     f"split evenly into {inputs.microbatches} micro-batches")
    workers = workers or choose_workers(inputs)
    best = hiertrain_search(inputs, workers)
    plan = inputs.plan(schedule_stages(best, inputs.num_layers), "hiertrain")
    plan = inputs.finish(plan)
    plan.predicted["hiertrain"] = {"mapping": best.mapping, "m_s": best.m_s, "m_l": best.m_l, "b": best.b,
                                   "t_total_s": best.total}
    return plan
