"""Brute force on small instances: the dynamic programs, the shortest path, the constrained
integer programs and the LPs find what exhaustive search finds."""
from __future__ import annotations

import itertools
import random
from itertools import permutations

import numpy as np
import pytest
from scipy.optimize import linprog

from planner.allocation import largest_remainder, memory_aware_allocation
from planner.asteroid import AsteroidDP, pipeline_estimate
from planner.asteroid_tables import AsteroidTables
from planner.baselines import balanced_split
from planner.costs import CostTable
from planner.hiertrain import HierTrainModel, round_samples, solve_mapping, solve_mapping_lp
from planner.inputs import PlanInputs
from planner.jointdnn import constrained_path, shortest_path, two_party_costs
from planner.memory import MemoryModel
from planner.synthetic import flops_cluster
from swarm.zoo import describe_model


def bent(table: CostTable, factors=(1.0, 1.4, 2.3)) -> CostTable:
    """A table measured at batch 1, 2, 4 that is not linear in the batch size."""
    f, b = table.fwd[:, 0], table.bwd[:, 0]
    sizes = (1, 2, 4)
    return CostTable(sizes, np.column_stack([f * k for k in factors]), np.column_stack([b * k for k in factors]),
                     table.update, [table.loss_fwd[0] * k for k in factors], [table.loss_bwd[0] * k for k in factors])


def random_cluster(rng: random.Random, desc, n: int, memories=("30 MiB", "60 MiB", "200 MiB", "1 GiB")):
    devs = {f"d{i}": (rng.choice([1, 2, 5, 10]), rng.choice(memories)) for i in range(n)}
    cl = flops_cluster(desc, devs, mbps=rng.choice([10, 100, 1000]), latency_ms=rng.choice([0, 1]),
                       mem_gbps=rng.choice([None, 5]))
    k = rng.randrange(n)
    cl.devices[k].costs = bent(cl.devices[k].costs.per_sample(1))
    return cl


@pytest.fixture(scope="module")
def small():
    desc = describe_model("yolov2-16", 32)
    return desc, MemoryModel.estimated(desc)


# ---- Asteroid ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_vectorised_alg1_equals_scalar(small, seed):
    desc, mem = small
    rng = random.Random(seed)
    cl = random_cluster(rng, desc, rng.choice([2, 3, 4]))
    micro = rng.choice([1, 2, 4])
    inputs = PlanInputs(desc, mem, cl, micro * rng.choice([1, 3, 5, 8]), micro)
    order = cl.names
    tables = AsteroidTables(inputs, order)
    group = list(range(len(order)))
    K = rng.choice([1, 3])
    cols = np.arange(len(tables.valid))
    caps = tables.caps(group, K, cols)
    y, feasible = tables.allocate(group, cols, caps)
    L = inputs.num_layers
    for col in rng.sample(range(len(cols)), 40):
        first, last = int(tables.vi[col]), int(tables.vj[col])
        want = memory_aware_allocation(
            order, inputs.microbatch,
            lambda d, n: cl.device(d).costs.range_time(first, last, n, last == L) if n else 0.0,
            lambda d: mem.max_batch(first, last, K, cl.device(d).memory), block=max(1, inputs.microbatch // 16))
        if want is None:
            assert not feasible[col]
        else:
            assert feasible[col] and [int(v) for v in y[:, col]] == [want[d] for d in order]


def brute_force_pipelines(inputs: PlanInputs, order: list[str]) -> float:
    L, N = inputs.num_layers, len(order)
    best = np.inf
    for p in range(1, min(L, N) + 1):
        for cuts in itertools.combinations(range(1, L), p - 1):
            bounds = [0, *cuts, L]
            for ends in itertools.combinations(range(1, N + 1), p):
                devs = [0, *ends]
                stages = [(bounds[k], bounds[k + 1], devs[k], devs[k + 1]) for k in range(p)]
                best = min(best, pipeline_estimate(inputs, order, stages))
    return best


@pytest.mark.parametrize("seed", range(16))
def test_asteroid_dp_finds_the_brute_force_optimum(small, seed):
    desc, mem = small
    rng = random.Random(100 + seed)
    if seed % 2:  # heterogeneous, memory-bound, slow links: mostly single-device stages
        cl = random_cluster(rng, desc, rng.choice([2, 3]))
        micro = rng.choice([1, 2, 4])
        inputs = PlanInputs(desc, mem, cl, micro * rng.choice([1, 2, 3]), micro)
    else:  # similar devices on fast links: data-parallel groups, all-reduces in the objective
        n = rng.choice([3, 4])
        devs = {f"d{i}": (rng.choice([4, 5]), rng.choice(["20 MiB", "1 GiB"])) for i in range(n)}
        cl = flops_cluster(desc, devs, mbps=rng.choice([300, 1000]), latency_ms=rng.choice([0, 0.2]))
        micro = rng.choice([2, 4])
        inputs = PlanInputs(desc, mem, cl, micro * rng.choice([4, 8]), micro)
    dp = AsteroidDP(inputs)
    pipelines = dp.solve()
    for pipe in pipelines:  # the DP's own numbers are the step-by-step formula's
        assert pipe.estimate == pytest.approx(pipeline_estimate(inputs, dp.order, pipe.stages), rel=1e-9)
    got = min((p.estimate for p in pipelines), default=np.inf)
    assert got == pytest.approx(brute_force_pipelines(inputs, dp.order), rel=1e-9)


def test_balanced_split_is_optimal():
    rng = random.Random(5)
    for _ in range(20):
        times = np.array([rng.uniform(0.1, 3) for _ in range(rng.randrange(3, 9))])
        parts = rng.randrange(1, len(times) + 1)
        bounds = balanced_split(times, parts)
        worst = max(times[a:b].sum() for a, b in zip(bounds, bounds[1:]))
        best = min(max(times[a:b].sum() for a, b in zip([0, *c], [*c, len(times)]))
                   for c in itertools.combinations(range(1, len(times)), parts - 1))
        assert worst == pytest.approx(best)


def test_largest_remainder():
    assert largest_remainder(7, {"a": 1.0, "b": 1.0, "c": 1.0}) == {"a": 3, "b": 2, "c": 2}
    assert sum(largest_remainder(10, {"a": 0.3, "b": 2.9}).values()) == 10


# ---- JointDNN ---------------------------------------------------------------------------

def jointdnn_inputs(seed: int, model="alexnet", img=None):
    rng = random.Random(seed)
    desc = describe_model(model, img)
    cl = flops_cluster(desc, {"mobile": (rng.choice([20, 100, 300]), "8 GiB"), "cloud": (rng.choice([500, 3000]), "8 GiB")},
                       data_source="mobile", latency_ms=rng.choice([0, 5, 20]), directed=True,
                       links={("mobile", "cloud"): rng.choice([1.1, 5.85, 18.88]),
                              ("cloud", "mobile"): rng.choice([2.03, 13.76, 54.97])}, mem_gbps=rng.choice([None, 25]))
    cl.devices[0].power_w = 10.0
    cl.devices[0].radio = {"up_mw_per_mbps": 283.17, "down_mw_per_mbps": 137.01, "base_mw": 132.86}
    return PlanInputs(desc, MemoryModel.estimated(desc), cl, rng.choice([1, 4, 16]), 1)


def all_placements(costs):
    for placement in itertools.product((0, 1), repeat=costs.num_layers):
        yield placement, costs.path_costs(list(placement))


def groups_to_placement(groups):
    return [x for i, j, x in groups for _ in range(i, j)]


@pytest.mark.parametrize("seed", range(6))
def test_jointdnn_shortest_path_is_optimal(seed):
    inputs = jointdnn_inputs(seed)
    costs = two_party_costs(inputs, "mobile", "cloud")
    value, groups = shortest_path(costs)
    best = min(c[0] for _, c in all_placements(costs))
    assert value == pytest.approx(best)
    assert costs.path_costs(groups_to_placement(groups))[0] == pytest.approx(value)
    e_value, _ = shortest_path(costs, (0.0, 1.0))
    assert e_value == pytest.approx(min(c[1] for _, c in all_placements(costs)))


@pytest.mark.parametrize("seed,form", [(0, "battery"), (1, "cloud"), (2, "qos"), (3, "battery"), (4, "qos")])
def test_jointdnn_constrained_forms_match_brute_force(seed, form):
    inputs = jointdnn_inputs(seed, "lenet5") if seed % 2 else jointdnn_inputs(seed)
    costs = two_party_costs(inputs, "mobile", "cloud")
    table = list(all_placements(costs))
    objective = {"battery": 0, "cloud": 0, "qos": 1}[form]
    side = {"battery": 1, "cloud": 2, "qos": 0}[form]
    sides = sorted(c[side] for _, c in table)
    budget = sides[len(sides) // 3]  # a budget that rules out two thirds of the placements
    best = min(c[objective] for _, c in table if c[side] <= budget + 1e-12)
    value, groups = constrained_path(costs, form, budget)
    assert value == pytest.approx(best, rel=1e-6, abs=1e-9)
    got = costs.path_costs(groups_to_placement(groups))
    assert got[side] <= budget * (1 + 1e-6) + 1e-9 and got[objective] == pytest.approx(best, rel=1e-6, abs=1e-9)


# ---- HierTrain --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hier():
    desc = describe_model("lenet5")
    cl = flops_cluster(desc, {"dev": (0.5, "1 GiB"), "edge": (2, "8 GiB"), "cloud": (20, "30 GiB")},
                       data_source="dev", latency_ms=1,
                       links={("dev", "edge"): 5, ("edge", "cloud"): 3, ("dev", "cloud"): 3})
    inputs = PlanInputs(desc, MemoryModel.estimated(desc), cl, 7, 1)
    return inputs, HierTrainModel(inputs, {"o": "edge", "s": "dev", "l": "cloud"})


def test_vertex_search_equals_highs_on_the_same_lps(hier):
    """solve_mapping's optimum of each pair's LP is HiGHS's (scipy's maintained LP solver) on
    the same LP, for every pair of cuts of every mapping of the three devices."""
    inputs, model = hier
    L = inputs.num_layers
    pairs = [(ms, ml) for ms in range(L + 1) for ml in range(ms, L + 1)]
    ms, ml = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    for perm in permutations(["edge", "dev", "cloud"]):
        other = HierTrainModel(inputs, dict(zip("osl", perm)))
        mine, highs = solve_mapping(other, pairs), solve_mapping_lp(other, ms, ml)
        for (a, b), x, y in zip(pairs, mine, highs):
            c = other.coefficients(a, b)
            assert sum(x) == pytest.approx(other.B) and min(x) >= 0
            assert (c["has_s"] or x[1] == 0) and (c["has_l"] or x[2] == 0)
            assert other.total(a, b, *x, c) == pytest.approx(other.total(a, b, *y, c), rel=1e-9, abs=1e-12), (a, b)


def test_relaxed_lp_bounds_every_integer_split(hier):
    """The LP optimum for (m_s, m_l) is at most T_total of every integer (b_o, b_s, b_l)."""
    inputs, model = hier
    B, L = model.B, inputs.num_layers
    pairs = [(ms, ml) for ms in range(L + 1) for ml in range(ms, L + 1)]
    for (ms, ml), x in zip(pairs, solve_mapping(model, pairs)):
        c = model.coefficients(ms, ml)
        relaxed = model.total(ms, ml, *x, c)
        for bs in range(B + 1 if c["has_s"] else 1):
            for bl in range(B + 1 - bs if c["has_l"] else 1):
                assert relaxed <= model.total(ms, ml, B - bs - bl, bs, bl, c) + 1e-12


def test_lp_matches_its_own_objective_by_direct_search(hier):
    """A direct search over a fine grid of real (b_s, b_l) never beats the LP."""
    inputs, model = hier
    B = model.B
    for ms, ml in [(2, 4), (0, 3), (1, 1), (3, 7)]:
        c = model.coefficients(ms, ml)
        (x,) = solve_mapping(model, [(ms, ml)])
        relaxed = model.total(ms, ml, *x, c)
        grid = np.linspace(0, B, 71)
        best = min(model.total(ms, ml, B - s - l, s, l, c) for s in grid for l in grid
                   if s + l <= B and (c["has_s"] or s == 0) and (c["has_l"] or l == 0))
        assert relaxed <= best + 1e-9


@pytest.mark.parametrize("x,total,want", [([2.6, 3.3, 1.1], 7, [3, 3, 1]), ([2.5, 2.5, 2.0], 7, [3, 2, 2]),
                                          ([1.4, 1.4, 4.2], 7, [2, 1, 4]), ([3.0, 4.0, 0.0], 7, [3, 4, 0])])
def test_hiertrain_rounding(x, total, want):
    assert round_samples(x, total) == want


def test_linprog_is_highs():
    """The LP solver is scipy's HiGHS (a maintained solver, not a hand-written simplex)."""
    res = linprog([1.0], bounds=[(1, 2)], method="highs")
    assert res.status == 0 and res.x[0] == pytest.approx(1.0)


def test_vectorised_hiertrain_equals_the_scalar_formulas(hier):
    inputs, model = hier
    rng = np.random.default_rng(3)
    L = inputs.num_layers
    ms = rng.integers(0, L + 1, 30)
    ml = np.maximum(ms, rng.integers(0, L + 1, 30))
    arrays = model.coefficient_arrays(ms, ml)
    splits = rng.dirichlet([1, 1, 1], 30) * model.B
    totals = model.totals(arrays, splits[:, 0], splits[:, 1], splits[:, 2])
    for k in range(30):
        assert totals[k] == pytest.approx(model.total(int(ms[k]), int(ml[k]), *splits[k]))
    from planner.hiertrain import round_splits
    assert [list(r) for r in round_splits(splits, model.B)] == [round_samples(list(x), model.B) for x in splits]
