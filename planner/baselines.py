"""The simple planners every other one is measured against, in two kinds.

By cost, from PlanInputs (`swarm plan`, and beside every other planner in `auto`):
- local: the whole model on one device (the data source, else the fastest device).
- dp: the whole model on every device, each micro-batch dealt out by Asteroid's Alg. 1
  (speed-proportional, memory-aware; devices left with no samples are dropped), or whole
  micro-batches per device: an equal share each, or as many as each finishes in time
  (uneven devices finish together); the fastest predicted.
- pp: GPipe — one stage per device in the cluster's order, layers split so the stages take
  equal time on an average device, every stage warming up with all M forwards.

By FLOPs and the user's own flags, from the devices' names alone (`swarm train --strategy
local|dp|pp|tiles|hybrid` without measurements, and re-planning after a loss): simple_plan,
with --grid, --sync, --stages, --together and --replicas as given.
"""
from __future__ import annotations

import math

import numpy as np

from planner.allocation import memory_aware_allocation
from planner.bounds import best_step, finish_best, sample_rate, samples_floor
from planner.classes import device_classes
from planner.inputs import NoPlan, PlanInputs
from planner.model_desc import ModelDesc
from planner.plan import Plan, PlanError, Stage, most_replicas
from planner.stage_work import group_microbatch_time
from tiles.layout import tileable_prefix

SIMPLE_STRATEGIES = ("local", "dp", "pp", "tiles", "hybrid")

# What a worker process holds besides the stage's weights and activations: the interpreter,
# torch and its kernels' scratch, messages in flight (an idle agent with a job's model
# loaded measures about 350 MiB on x86-64 Linux).
RUNTIME_BYTES = 400 * 2**20
# Activations measured against the tiles cost model's count: the allocator's slack and the
# temporaries of a layer's backward that the model does not count.
ACTIVATION_SLACK = 1.4


def square_grid(n: int, height: int = 1, width: int = 1) -> tuple[int, int]:
    """The most square rows x cols with rows * cols == n, its longer side along the longer side
    of a height x width map (8 tiles: 2x4 over a square or wide map, 4x2 over a tall one)."""
    rows = int(math.isqrt(n))
    while n % rows:
        rows -= 1
    return (n // rows, rows) if height > width else (rows, n // rows)


def parse_syncs(text: str | None, first: int, last: int) -> list[int] | None:
    """--sync: "all" (every layer, the default), "none" (one group), or layer numbers."""
    if text is None or text == "all":
        return None
    if text == "none":
        return [first]
    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise PlanError(f"--sync takes 'all', 'none' or layer numbers like 0,4,8, not '{text}'") from None
    bad = [x for x in layers if not first <= x < last]
    if bad:
        raise PlanError(f"--sync layers {bad} are outside the tiles stage (layers {first}-{last - 1})")
    return sorted(set(layers) | {first})


def even_cuts(desc: ModelDesc, first: int, last: int, parts: int) -> list[int]:
    """Boundaries splitting layers [first, last) into `parts` ranges of about equal FLOPs
    (forward + backward), each at least one layer: the ends of the ranges, `last` included."""
    n = last - first
    if not 1 <= parts <= n:
        raise PlanError(f"cannot split {n} layers into {parts} stages")
    cost = np.array([desc.layers[i].flops + desc.layers[i].backward_flops + 1 for i in range(first, last)], float)
    return [first + b for b in balanced_split(cost, parts)[1:]]


def _plan(desc: ModelDesc, batch: int, microbatches: int, stages: list[Stage], devices: dict, name: str) -> Plan:
    plan = Plan(desc.name, desc.img_size, batch, microbatches, stages, devices=devices, planner=name)
    plan.validate(desc)
    return plan


def even_allocation(group: list[str], samples: int) -> dict[str, int]:
    base, extra = divmod(samples, len(group))
    return {d: base + (1 if i < extra else 0) for i, d in enumerate(group)}


def blocks_that_fit(desc: ModelDesc, stage: Stage, batch: int, microbatches: int, facts: dict) -> int:
    """The most micro-batches a one-stage tiles plan can run as one block (a divisor of
    each replica's share of `microbatches`) with every device's estimated peak within its
    memory; 1 when a device's memory is unknown."""
    from planner.memory import MemoryModel
    from planner.tiles_work import tiles_cost

    memory = [facts.get(d, {}).get("memory") for d in stage.devices]
    if not all(memory):
        return 1
    cost = tiles_cost(desc, stage)
    weights = MemoryModel.estimated(desc).weights(stage.first, stage.last)
    n = stage.tiles_per_replica()
    per_sample = {d: sum(cost.tiles[k % n].peak_bytes for k, o in enumerate(stage.tile_devices) if o == d)
                  for d in stage.devices}
    mb = -(-batch // microbatches)
    share = microbatches // stage.replica_count()
    best = 1
    for size in range(1, share + 1):
        if share % size:
            continue
        need = {d: RUNTIME_BYTES + weights + ACTIVATION_SLACK * size * mb * per_sample[d] for d in stage.devices}
        if all(need[d] <= m for d, m in zip(stage.devices, memory)):
            best = size
    return best


def simple_plan(strategy: str, desc: ModelDesc, devices: list[str], batch: int, microbatches: int, *,
                grid: tuple[int, int] | None = None, sync: str | None = None, stages: int | None = None,
                facts: dict | None = None, together: int | None = None, replicas: int | None = None) -> Plan:
    """A plan of `strategy` over `devices` (names, in order). A tiles plan of one stage runs
    `together` micro-batches as one block (default: as many as fit in the devices' memory);
    with `replicas` R it splits the devices into R equal groups, each with its own grid
    (`grid`, or the most square one) running its share of the micro-batches. A dp plan
    shares each micro-batch among the devices, or, when the micro-batches are too small to
    keep them busy (or `replicas` says so), gives each of R devices whole micro-batches."""
    if not devices:
        raise PlanError("no devices to plan for")
    n = len(desc.layers)
    known = {d: (facts or {}).get(d, {}) for d in devices}
    if strategy == "local":
        return _plan(desc, batch, microbatches, [Stage(0, n, "single", [devices[0]])], known, "local")
    if strategy == "dp":
        if batch % microbatches:
            raise PlanError(f"dp needs the batch ({batch}) to split evenly into {microbatches} micro-batches")
        if replicas is not None:
            if replicas > len(devices):
                raise PlanError(f"--replicas {replicas} needs at least {replicas} devices, found {len(devices)}")
            copies = replicas
        else:  # whole micro-batches per device when that keeps more devices busy than sharing each one
            copies = most_replicas(microbatches, len(devices))
            if copies <= min(len(devices), batch // microbatches):
                copies = 1
        if copies > 1:
            return _plan(desc, batch, microbatches, [Stage(0, n, "single", devices[:copies], replicas=copies)],
                         known, "dp")
        group = devices[:batch // microbatches]  # no device without a sample
        return _plan(desc, batch, microbatches,
                     [Stage(0, n, "dp", group, allocation=even_allocation(group, batch // microbatches))], known, "dp")
    if strategy == "pp":
        count = stages or len(devices)
        if count > len(devices):
            raise PlanError(f"--stages {count} needs {count} devices, found {len(devices)}")
        bounds = [0, *even_cuts(desc, 0, n, count)]
        return _plan(desc, batch, microbatches,
                     [Stage(bounds[i], bounds[i + 1], "single", [devices[i]]) for i in range(count)], known, "pp")
    if strategy == "tiles":
        end = tileable_prefix(desc)
        if end == 0:
            raise PlanError(untileable(desc))
        copies = replicas or 1
        if copies > len(devices):
            raise PlanError(f"--replicas {copies} needs at least {copies} devices, found {len(devices)}")
        if microbatches % copies:
            raise PlanError(f"--replicas {copies} must divide the {microbatches} micro-batches")
        size = len(devices) // copies
        rows, cols = grid or square_grid(size, *desc.layers[0].in_shape[1:])
        tile_devices = [devices[r * size + k % size] for r in range(copies) for k in range(rows * cols)]
        group = list(dict.fromkeys(tile_devices))
        plan_stages = [Stage(0, end, "tiles", group, grid=(rows, cols), tile_devices=tile_devices,
                             syncs=parse_syncs(sync, 0, end), replicas=copies if copies > 1 else None)]
        if end < n:
            plan_stages.append(Stage(end, n, "single", [devices[0]]))
            for flag, value in (("--together", together), ("--replicas", replicas)):
                if value not in (None, 1):
                    raise PlanError(f"{flag} needs the whole of {desc.name} in the tiles stage; it has untileable "
                                    f"layers from layer {end}")
        else:
            plan_stages[0].together = together or blocks_that_fit(desc, plan_stages[0], batch, microbatches, known)
        return _plan(desc, batch, microbatches, plan_stages, known, "tiles")
    if strategy == "hybrid":
        return _hybrid(desc, devices, batch, microbatches, grid, sync, known)
    raise PlanError(f"unknown strategy '{strategy}'; use one of {', '.join(SIMPLE_STRATEGIES)}")


def untileable(desc: ModelDesc) -> str:
    """Why a network's front cannot be a tiles stage, in one line."""
    first = desc.layers[0]
    if first.spatial and first.inputs == (-1,):
        return (f"{desc.name} cannot be tiled: layer 0's map is read again further on (a skip), and a tiles stage "
                "must end where only its own output leaves it")
    return (f"{desc.name} starts with layer 0 ({first.kind}), which tiles cannot take: a tiles stage begins with "
            "convolution or local pooling windows (ungrouped, undilated, one stride on both axes), each reading "
            "the one before")


def _hybrid(desc: ModelDesc, devices: list[str], batch: int, microbatches: int, grid, sync, known) -> Plan:
    """A tiles stage on the first half of the devices over the first third of the work,
    then a dp stage on the others, then a single stage on the first device."""
    if len(devices) < 3:
        raise PlanError(f"hybrid needs at least 3 devices, found {len(devices)}")
    if batch % microbatches:
        raise PlanError(f"hybrid has a dp stage: the batch ({batch}) must split evenly into {microbatches} micro-batches")
    n = len(desc.layers)
    end = tileable_prefix(desc)
    if end == 0:
        raise PlanError(f"hybrid starts with a tiles stage, but {untileable(desc)}")
    tiles_n = (len(devices) + 1) // 2
    rows, cols = grid or square_grid(tiles_n, *desc.layers[0].in_shape[1:])
    tile_group = devices[:tiles_n]
    tile_devices = [tile_group[k % len(tile_group)] for k in range(rows * cols)]
    first_cut, second_cut = even_cuts(desc, 0, n, 3)[:2]
    first_cut = min(first_cut, end)
    while first_cut > 1 and (desc.live_after(first_cut) != (first_cut - 1,)):
        first_cut -= 1  # a tiles stage must end where only its own output is live
    second_cut = max(second_cut, first_cut + 1)
    dp_group = devices[tiles_n:][:batch // microbatches]
    return _plan(desc, batch, microbatches, [
        Stage(0, first_cut, "tiles", list(dict.fromkeys(tile_devices)), grid=(rows, cols), tile_devices=tile_devices,
              syncs=parse_syncs(sync, 0, first_cut)),
        Stage(first_cut, second_cut, "dp", dp_group, allocation=even_allocation(dp_group, batch // microbatches)),
        Stage(second_cut, n, "single", [devices[0]]),
    ], known, "hybrid")


def plan_local(inputs: PlanInputs, device: str | None = None) -> Plan:
    cluster = inputs.cluster
    name = device or cluster.data_source or cluster.by_speed(inputs.microbatch)[0]
    plan = inputs.plan([Stage(0, inputs.num_layers, "single", [name])], "local")
    return inputs.finish(plan)


def dp_allocation(inputs: PlanInputs, group: list[str], first: int, last: int, warmup: int,
                  budgets: dict[str, float] | None = None) -> dict[str, int] | None:
    """Alg. 1 for layers [first, last) over `group` (None: the group's memory is too small)."""
    cluster, mem = inputs.cluster, inputs.mem
    with_loss = last == inputs.num_layers
    budgets = budgets or {d: cluster.device(d).memory for d in group}

    def time_of(d: str, y: int) -> float:
        return cluster.device(d).costs.range_time(first, last, y, with_loss) if y else 0.0

    def max_batch(d: str) -> int:
        return mem.max_batch(first, last, warmup, budgets[d])

    return memory_aware_allocation(group, inputs.microbatch, time_of, max_batch, block=max(1, inputs.microbatch // 16))


def plan_dp(inputs: PlanInputs, bound: float | None = None) -> Plan | None:
    """The best of the data-parallel shapes (module docstring). With `bound` (auto's best
    step so far), candidates whose devices cannot compute a step in less are not simulated,
    and None says that none could beat it."""
    if inputs.batch_size % inputs.microbatches:
        raise NoPlan(f"data parallelism needs the batch ({inputs.batch_size}) to split evenly into "
                     f"{inputs.microbatches} micro-batches")
    group = inputs.cluster.by_speed(inputs.microbatch)
    alloc = dp_allocation(inputs, group, 0, inputs.num_layers, 1)
    if alloc is None:  # memory too small even together: deal by speed alone and report the overflow
        alloc = memory_aware_allocation(group, inputs.microbatch, lambda d, y: inputs.cluster.reference_time(d, max(y, 1)) * y,
                                        lambda d: inputs.microbatch)
    alloc = {d: y for d, y in alloc.items() if y > 0}
    mode = "dp" if len(alloc) > 1 else "single"
    stage = Stage(0, inputs.num_layers, mode, list(alloc), allocation=alloc if mode == "dp" else None)
    candidates = [inputs.plan([stage], "dp")]
    copies = most_replicas(inputs.microbatches, len(group))
    if copies > len(alloc):  # whole micro-batches per device keep more devices busy: the fastest that many
        candidates.append(inputs.plan([Stage(0, inputs.num_layers, "single", group[:copies], replicas=copies)], "dp"))
    dealt = deal_microbatches(inputs, group)
    if len(dealt) > 1:  # uneven devices: each takes as many whole micro-batches as it finishes in time
        shares = list(dealt.values())
        candidates.append(inputs.plan([Stage(0, inputs.num_layers, "single", list(dealt), replicas=len(dealt),
                                             shares=shares if len(set(shares)) > 1 else None)], "dp"))
    best = finish_best(inputs, candidates, bound)
    for devices in without_slow_links(inputs, group):  # groups of devices, each taking whole micro-batches
        fewest = fewest_worth(inputs, devices, best_step(best, bound))
        stages = replica_groups(inputs, devices, fewest)
        best = finish_best(inputs, [inputs.plan([s], "dp") for s in stages], bound, best)
    return best


def fewest_worth(inputs: PlanInputs, devices: list[str], step: float | None) -> int:
    """The fewest of `devices` (fastest first) whose summed rate could still compute the
    batch in less than `step` (planner/bounds.py); 2 when there is no step to beat."""
    if step is None:
        return 2
    rates = np.cumsum([sample_rate(inputs, d) for d in devices])
    for k in range(len(devices), 1, -1):
        if samples_floor(inputs, rates[k - 1]) >= step:
            return k + 1
    return 2


def without_slow_links(inputs: PlanInputs, group: list[str]) -> list[list[str]]:
    """`group`, and `group` without the devices on its slowest links, one rate after another:
    every device of a dp stage moves about twice the gradients over its link each step, so
    one slow link paces the whole ring, and the way around it is to leave its device out."""
    cluster = inputs.cluster
    # a device's own link: the best rate it reaches anyone at (a pair runs at the slower end's)
    link = {d: max((cluster.bw(d, e) for e in group if e != d), default=math.inf) for d in group}
    out = [group]
    for rate in sorted(set(link.values()))[:-1]:
        left = [d for d in out[-1] if link[d] > rate]
        if len(left) >= 2:
            out.append(left)
    return out


def replica_groups(inputs: PlanInputs, group: list[str], fewest: int = 2) -> list[Stage]:
    """dp stages whose replicas are groups of devices, each group splitting the micro-batches
    it takes (Alg. 1 inside it) and taking as many as it finishes in time: on a mixed swarm
    whose small devices each hold only part of a micro-batch, the small ones pool into
    groups while a large one runs micro-batches alone, and all of them end together.

    Groups are runs of consecutive devices in `group`'s order (fastest first: a group is
    paced by its slowest member), some devices possibly left out. For each number k of the
    fastest devices, the shortest makespan T over the k is found exactly for that family:
    a group S finishes floor(T / t_S) micro-batches in T, where t_S is its time for one (a
    group of several paced by its slowest member between BatchNorm layers, its exchanges
    included: stage_work.group_microbatch_time);
    the runs that finish the most in T come from a DP over the devices, and T is the least
    of the candidate times k * t_S for which they finish all M. Beside it, for each k, the k
    cut into groups of one size (_even_runs). Stages of at least two groups; the simulator
    then judges them with their gradient rings and BatchNorm exchanges.

    A run of more devices than a micro-batch has samples would leave one idle, so runs are
    at most that long; devices of one class (planner/classes.py) cost alike, so a run is
    allocated once per class make-up. `fewest`: the smallest k worth trying (fewer devices
    cannot beat the best plan found so far, fewest_worth)."""
    n, micro = inputs.num_layers, inputs.microbatches
    if len(group) < 2 or micro < 2:
        return []
    cl = inputs.cluster
    kinds = device_classes(cl)
    kind = [kinds[cl.index(d)] for d in group]
    costed: dict[tuple[int, ...], tuple[float, list[int]] | None] = {}  # class make-up -> (time, samples)
    runs: dict[tuple[int, int], tuple[float, dict[str, int]]] = {}  # [i, j) -> (time per micro-batch, allocation)
    for i in range(len(group)):
        for j in range(i + 1, min(len(group), i + inputs.microbatch) + 1):
            makeup = tuple(kind[i:j])
            if makeup not in costed:
                alloc = dp_allocation(inputs, group[i:j], 0, n, 1)
                if alloc is None or min(alloc.values()) == 0:  # cannot hold it, or a member would idle
                    costed[makeup] = None
                else:
                    costed[makeup] = (group_microbatch_time(inputs.desc, cl, alloc, 0, n, True), list(alloc.values()))
            if costed[makeup] is not None:
                t, samples = costed[makeup]
                runs[(i, j)] = (t, dict(zip(group[i:j], samples)))
    stages, seen = [], set()
    for k in range(len(group), max(2, fewest) - 1, -1):
        usable = {ij: v for ij, v in runs.items() if ij[1] <= k}
        for chosen in [_fastest_runs(usable, k, micro), *_even_runs(usable, k)]:
            stage = _replica_stage(chosen, usable, n, micro, seen)
            if stage is not None:
                stages.append(stage)
    return stages


def _even_runs(runs: dict[tuple[int, int], tuple[float, dict]], k: int) -> list[list[tuple[int, int]]]:
    """Devices [0, k) cut into groups of one size (two or more groups of two or more
    devices), where each group can take micro-batches. On equal devices these tie with the
    fastest runs in compute, and their profiles' noise would otherwise decide between, say,
    four pairs and two pairs with a quartet, which differ in what they exchange."""
    return [[(i, i + size) for i in range(0, k, size)] for size in range(2, k // 2 + 1)
            if k % size == 0 and all((i, i + size) in runs for i in range(0, k, size))]


def _replica_stage(chosen, usable, n: int, micro: int, seen: set) -> Stage | None:
    """The dp stage over layers [0, n) whose replicas are the groups `chosen` (runs of
    `usable`), each taking the micro-batches it finishes in time; None for fewer than two
    groups or a stage made already."""
    if chosen is None or len(chosen) < 2 or tuple(chosen) in seen:
        return None
    shares = _deal([usable[ij][0] for ij in chosen], micro)
    chosen = [ij for ij, k in zip(chosen, shares) if k]  # a group dealt nothing is not in the plan
    shares = [k for k in shares if k]
    if len(chosen) < 2 or tuple(chosen) in seen:
        return None
    seen.add(tuple(chosen))
    allocation = {d: y for ij in chosen for d, y in usable[ij][1].items()}
    return Stage(0, n, "dp", list(allocation), allocation=allocation, replicas=len(chosen),
                 groups=[len(usable[ij][1]) for ij in chosen], shares=shares if len(set(shares)) > 1 else None)


def _fastest_runs(runs: dict[tuple[int, int], tuple[float, dict]], k: int, micro: int) -> list[tuple[int, int]] | None:
    """The disjoint runs of devices [0, k) that finish `micro` micro-batches soonest."""
    starting: dict[int, list[tuple[int, float]]] = {}  # first device -> (end, time) of its runs, in runs' order
    for (a, b), (t, _) in runs.items():
        starting.setdefault(a, []).append((b, t))

    def most(T: float) -> tuple[int, list]:
        best: list[tuple[int, list]] = [(0, [])] * (k + 1)  # best[i]: from device i on
        for i in range(k - 1, -1, -1):
            best[i] = best[i + 1]  # device i left out
            for b, t in starting.get(i, ()):
                done = min(micro, int(T / t + 1e-9))
                if done and done + best[b][0] > best[i][0]:
                    best[i] = (done + best[b][0], [(i, b), *best[b][1]])
        return best[0]

    times = sorted({t * m for t, _ in runs.values() for m in range(1, micro + 1)})
    lo, hi = 0, len(times) - 1
    if not times or most(times[hi])[0] < micro:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if most(times[mid])[0] >= micro:
            hi = mid
        else:
            lo = mid + 1
    return most(times[lo])[1]


def _deal(times: list[float], micro: int) -> list[int]:
    """Whole micro-batches dealt one at a time to whichever group would finish it first."""
    busy, count = [0.0] * len(times), [0] * len(times)
    for _ in range(micro):
        g = min(range(len(times)), key=lambda g: busy[g] + times[g])
        busy[g] += times[g]
        count[g] += 1
    return count


def deal_microbatches(inputs: PlanInputs, group: list[str]) -> dict[str, int]:
    """Whole micro-batches dealt one at a time to the device that would finish it first (list
    scheduling by each device's time for a micro-batch of the whole model), among the devices
    that hold the model and a micro-batch: {device: micro-batches}, in `group` order, without
    the devices that got none."""
    cluster, mem, n = inputs.cluster, inputs.mem, inputs.num_layers
    able = [d for d in group if mem.max_batch(0, n, 1, cluster.device(d).memory) >= inputs.microbatch]
    took = {d: cluster.device(d).costs.range_time(0, n, inputs.microbatch, with_loss=True) for d in able}
    busy, count = dict.fromkeys(able, 0.0), dict.fromkeys(able, 0)
    for _ in range(inputs.microbatches if able else 0):
        d = min(able, key=lambda d: busy[d] + took[d])
        busy[d] += took[d]
        count[d] += 1
    return {d: k for d, k in count.items() if k}


def balanced_split(layer_times: np.ndarray, parts: int) -> list[int]:
    """Boundaries [0, b1, ..., L] of `parts` contiguous blocks minimising the largest block's
    time (the linear-partition dynamic program)."""
    n = len(layer_times)
    parts = max(1, min(parts, n))
    cum = np.concatenate([[0.0], np.cumsum(layer_times)])
    best = np.full((parts + 1, n + 1), np.inf)
    cut = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            i = np.arange(k - 1, j)
            cost = np.maximum(best[k - 1, i], cum[j] - cum[i])
            a = int(np.argmin(cost))
            best[k, j], cut[k, j] = cost[a], i[a]
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(int(cut[k, bounds[-1]]))
    return bounds[::-1]


def plan_pp(inputs: PlanInputs) -> Plan:
    cluster = inputs.cluster
    names = cluster.names
    parts = min(len(names), inputs.num_layers)
    mb = inputs.microbatch
    times = np.mean([[d.costs.range_time(i, i + 1, mb) for i in range(inputs.num_layers)] for d in cluster.devices], axis=0)
    bounds = balanced_split(times, parts)
    stages = [Stage(a, b, "single", [names[k]], warmup=inputs.microbatches)
              for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return inputs.finish(inputs.plan(stages, "pp"))
