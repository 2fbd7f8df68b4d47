"""Pipelines of replicated stages: each stage a few devices taking whole micro-batches.

A stage whose devices split every micro-batch (a dp group) exchanges BatchNorm sums at
every BatchNorm layer of every micro-batch, forward and backward, and its devices wait on
each other at each; on slow devices those exchanges, not the computation, set the pace.
A replicated stage (Stage.replicas) gives each of its devices whole micro-batches instead:
it exchanges nothing while it computes, and sums its gradients once a step. It costs a
whole micro-batch's maps on each device, and a longer drain: the last micro-batch's
backward through the stage runs on one device. The replicas take the micro-batches in turn
(Stage.deal), so that each ends the step with one backward, not a run of them.

The search: devices fastest first, layer boundaries as Asteroid's (candidate_cuts), and a
dynamic program over (first layer, first free device) for the pipeline whose busiest device
has the least work: a stage of layers [i, j) on the next k devices takes micro-batches in
shares that even out their finishing (shares_for), and its load is its busiest device's
shares times its time per micro-batch, and the stage's gradient sum. The best of each stage
count are then simulated, which counts what the load leaves out (the fill and drain, the
transfers, the sum hidden behind the next step), and the fastest that fits is the plan.
"""
from __future__ import annotations

from functools import lru_cache

from planner.asteroid import candidate_cuts
from planner.inputs import NoPlan, PlanInputs
from planner.plan import Plan, PlanError, Stage
from planner.stage_work import gradient_buckets, ring_allreduce_time

MAX_DEVICES = 16  # larger swarms: Asteroid's groups (the search below grows with devices squared)
MAX_CUTS = 24  # layer boundaries the search cuts at
MAX_STAGES = 8  # deeper pipelines fill and drain through too many stages to pay
KEEP = 4  # pipelines the search keeps for each first layer, first device and stage count
CANDIDATES = 32  # the best pipelines by load and fill that are simulated


def shares_for(times: list[float], microbatches: int) -> list[int]:
    """Whole micro-batches for devices taking `times` seconds each per micro-batch: one each,
    then each further one to the device that would finish it soonest (the earliest first on
    a tie)."""
    shares = [1] * len(times)
    for _ in range(microbatches - len(times)):
        k = min(range(len(times)), key=lambda i: ((shares[i] + 1) * times[i], i))
        shares[k] += 1
    return shares


def plan_replicated(inputs: PlanInputs, bound: float | None = None) -> Plan | None:
    """The fastest pipeline of replicated stages that fits, or None (a swarm of one device or
    more than MAX_DEVICES, a model of one layer, or nothing beats `bound`)."""
    cl, M, mb = inputs.cluster, inputs.microbatches, inputs.microbatch
    order = cl.by_speed(mb)
    N = len(order)
    if N < 2 or N > MAX_DEVICES or inputs.num_layers < 2:
        return None
    cuts = candidate_cuts(inputs, MAX_CUTS)
    L = len(cuts) - 1
    mem = inputs.mem
    beaten = []  # stages left out because they cannot beat `bound`

    @lru_cache(maxsize=None)
    def load(i: int, j: int, a: int, k: int, warmup: int) -> tuple[float, float, tuple[int, ...]] | None:
        """A stage of layers [cuts[i], cuts[j]) on order[a:a+k], warming up with `warmup`
        forwards: its busiest device's work, a micro-batch's time on its slowest device, and
        the shares; None where a device cannot hold its micro-batches in flight."""
        first, last = cuts[i], cuts[j]
        with_loss = last == inputs.num_layers
        names = order[a:a + k]
        times = [cl.device(d).costs.range_time(first, last, mb, with_loss) for d in names]
        shares = shares_for(times, M)
        for d, share in zip(names, shares):
            if mem.stage(first, last, mb, min(share, warmup)) > mem.budget(first, last, cl.device(d).memory):
                return None
        summed = 0.0
        if k > 1:  # the gradient sum over the replicas, as if nothing hid it
            summed = ring_allreduce_time(float(mem.param_bytes[first:last].sum()), names, cl,
                                         gradient_buckets(mem, first, last), dict(zip(names, shares)))
        work = max(s * t for s, t in zip(shares, times)) + summed
        if bound is not None and work >= bound:  # a step that takes this device longer cannot win
            beaten.append((i, j, a, k))
            return None
        return work, max(times), tuple(shares)

    @lru_cache(maxsize=None)
    def best(i: int, a: int, stages: int) -> tuple:
        """The KEEP pipelines of least load of `stages` stages over layers [cuts[i], L) from
        device a on, each (load, one micro-batch's time through them, stages)."""
        if stages == 1:
            options = [(L, k) for k in range(1, min(M, N - a) + 1)]
        else:
            options = [(j, k) for j in range(i + 1, L) for k in range(1, min(M, N - a - (stages - 1)) + 1)]
        found = []
        for j, k in options:
            here = load(i, j, a, k, 2 * stages - 1)  # Asteroid's K_p: this stage has stages - 1 after it
            if here is None:
                continue
            for rest in (((0.0, 0.0, ()),) if stages == 1 else best(j, a + k, stages - 1)):
                found.append((max(here[0], rest[0]), here[1] + rest[1],
                              ((cuts[i], cuts[j], a, k, here[2]),) + rest[2]))
        return tuple(sorted(found, key=lambda q: (q[0], q[1]))[:KEEP])

    # each stage count's best by load, ranked by load plus the fill and drain (one micro-batch
    # through every stage), the first CANDIDATES simulated
    pipelines = sorted((q for p in range(2, min(N, L, MAX_STAGES) + 1) for q in best(0, 0, p)),
                       key=lambda q: q[0] + q[1])
    plans = []
    for _, _, stages in pipelines[:CANDIDATES]:
        built = []
        for first, last, a, k, shares in stages:
            names = order[a:a + k]
            built.append(Stage(first, last, "single", names) if k == 1 else
                         Stage(first, last, "single", names, replicas=k, shares=list(shares), deal="turns"))
        try:
            plans.append(inputs.finish(inputs.plan(built, "replicated")))
        except PlanError:
            continue
    if not plans:
        if beaten:
            return None
        raise NoPlan("no pipeline of replicated stages fits the devices' memory")
    plans.sort(key=lambda q: (not q.predicted["fits"], q.predicted["step_time_s"]))
    if bound is not None and plans[0].predicted["step_time_s"] >= bound:
        return None
    return plans[0]
