"""JointDNN (Eshratifar et al., section 2): place consecutive-layer groups on two parties by a
shortest path; training is the forward pass plus its mirrored backward.

Graph (Fig. 6): node (i, j, X) runs layers [i, j) on party X, forward and — mirrored —
backward, plus their optimizer update. An edge from a node ending at boundary j on X to a
node starting at j on Y costs nothing if X = Y, else the activation crossing boundary j
going X -> Y and its gradient coming back Y -> X. The start pays for uploading the images
when the first group is not on the party holding the data; the loss stays on the last
party. Weights stay where their layers run (this swarm does not bring them back to the
mobile every step, as JointDNN's mobile-side inference does).

Objectives: latency (the shortest path, solved exactly by dynamic programming over the
DAG), or mobile energy (JointDNN eq. 21: compute power while computing, P = alpha * rate
+ beta while sending or receiving). Constrained forms (section 2.4.5) are integer
programs over the same graph, solved by scipy's HiGHS MILP:
    battery:  min latency  s.t. mobile energy <= budget
    cloud:    min latency  s.t. cloud compute time <= budget
    qos:      min energy   s.t. latency <= deadline
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from planner.inputs import NoPlan, PlanInputs
from planner.plan import Plan, Stage
from planner.stage_work import IMAGE_BYTES_PER_VALUE


@dataclass
class TwoPartyCosts:
    """Per-step costs of every layer and boundary for parties 0 (mobile, holds the data) and 1 (cloud)."""

    parties: tuple[str, str]
    compute: np.ndarray  # (2, L) seconds: forward + backward of the step's samples, + update
    cross: np.ndarray  # (2, L + 1) seconds to cross boundary b starting on party X (act there, grad back)
    upload: np.ndarray  # (2,) seconds to get the images to party X
    energy_compute: np.ndarray  # (2, L) mobile joules while party X computes layer l
    energy_cross: np.ndarray  # (2, L + 1) mobile joules for crossing boundary b from party X
    energy_upload: np.ndarray  # (2,)

    @property
    def num_layers(self) -> int:
        return self.compute.shape[1]

    def path_costs(self, placement: list[int]) -> tuple[float, float, float]:
        """(latency, mobile energy, cloud compute time) of a per-layer placement (0 or 1)."""
        lat = self.upload[placement[0]]
        energy = self.energy_upload[placement[0]]
        cloud = 0.0
        for layer, x in enumerate(placement):
            lat += self.compute[x, layer]
            energy += self.energy_compute[x, layer]
            cloud += self.compute[x, layer] if x == 1 else 0.0
            if layer + 1 < len(placement) and placement[layer + 1] != x:
                lat += self.cross[x, layer + 1]
                energy += self.energy_cross[x, layer + 1]
        return float(lat), float(energy), float(cloud)


def radio_power_w(radio: dict | None, direction: str, rate_bytes_per_s: float) -> float:
    """JointDNN eq. 21: P = alpha * throughput (Mbit/s) + beta, in watts."""
    if not radio:
        return 0.0
    alpha = float(radio.get(f"{direction}_mw_per_mbps", 0.0))
    return (alpha * rate_bytes_per_s * 8 / 1e6 + float(radio.get("base_mw", 0.0))) / 1000


def two_party_costs(inputs: PlanInputs, mobile: str, cloud: str) -> TwoPartyCosts:
    cl, mem, L = inputs.cluster, inputs.mem, inputs.num_layers
    mb, M = inputs.microbatch, inputs.microbatches
    parties = (mobile, cloud)
    compute = np.zeros((2, L))
    for x, name in enumerate(parties):
        costs = cl.device(name).costs
        for layer in range(L):
            t = costs.range_time(layer, layer + 1, mb, with_loss=(layer == L - 1))
            compute[x, layer] = M * t + costs.update_range(layer, layer + 1)
    cross = np.zeros((2, L + 1))
    e_cross = np.zeros((2, L + 1))
    mob = cl.device(mobile)
    up_w = radio_power_w(mob.radio, "up", cl.bw(mobile, cloud))
    down_w = radio_power_w(mob.radio, "down", cl.bw(cloud, mobile))
    for b in range(1, L):
        nbytes = inputs.batch_size * mem.boundary(b)
        copies = cl.device(mobile).copy_time(nbytes) + cl.device(cloud).copy_time(nbytes)  # host<->accelerator
        t_up = M * cl.latency + nbytes / cl.bw(mobile, cloud) + copies  # activations up, gradients come down
        t_down = M * cl.latency + nbytes / cl.bw(cloud, mobile) + copies
        cross[0, b] = cross[1, b] = t_up + t_down
        e_cross[0, b] = e_cross[1, b] = t_up * up_w + t_down * down_w
    image = inputs.batch_size * inputs.desc.input_bytes // 4 * IMAGE_BYTES_PER_VALUE
    src = cl.data_source or mobile
    upload = np.array([cl.transfer_time(src, mobile, image), cl.transfer_time(src, cloud, image)])
    e_upload = np.array([0.0, upload[1] * up_w if src == mobile else 0.0])
    power = mob.power_w or 0.0
    e_compute = np.vstack([compute[0] * power, np.zeros(L)])
    return TwoPartyCosts(parties, compute, cross, upload, e_compute, e_cross, e_upload)


def shortest_path(c: TwoPartyCosts, weights: tuple[float, float] = (1.0, 0.0)) -> tuple[float, list[tuple[int, int, int]]]:
    """The shortest path S -> F over groups (i, j, X), for cost = w0 * latency + w1 * energy.
    Returns (cost, [(first, last, party), ...]) with consecutive groups merged."""
    w_lat, w_en = weights
    comp = w_lat * c.compute + w_en * c.energy_compute
    cross = w_lat * c.cross + w_en * c.energy_cross
    up = w_lat * c.upload + w_en * c.energy_upload
    L = c.num_layers
    cum = np.concatenate([np.zeros((2, 1)), np.cumsum(comp, axis=1)], axis=1)  # group (i, j) on X: cum[X, j] - cum[X, i]
    best = np.full((L + 1, 2), np.inf)  # best[j, X]: a path whose last group ends at j on X
    came = {}
    arrive = np.full((L + 1, 2), np.inf)  # cheapest way to start a group at boundary i on X
    arrive_from = {}
    for i in range(L):
        for x in (0, 1):
            if i == 0:
                arrive[0, x], arrive_from[(0, x)] = up[x], None
            else:
                stay, switch = best[i, x], best[i, 1 - x] + cross[1 - x, i]
                arrive[i, x], arrive_from[(i, x)] = (stay, x) if stay <= switch else (switch, 1 - x)
        for x in (0, 1):
            js = np.arange(i + 1, L + 1)
            cand = arrive[i, x] + cum[x, js] - cum[x, i]
            better = cand < best[js, x]
            best[js[better], x] = cand[better]
            for j in js[better]:
                came[(int(j), x)] = i
    x = int(np.argmin(best[L]))
    cost = float(best[L, x])
    groups, j = [], L
    while j > 0:
        i = came[(j, x)]
        groups.append((i, j, x))
        prev = arrive_from[(i, x)]
        if prev is None:
            break
        j, x = i, prev
    return cost, merge_groups(groups[::-1])


def merge_groups(groups: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for i, j, x in groups:
        if out and out[-1][2] == x and out[-1][1] == i:
            out[-1] = (out[-1][0], j, x)
        else:
            out.append((i, j, x))
    return out


def constrained_path(c: TwoPartyCosts, objective: str, budget: float) -> tuple[float, list[tuple[int, int, int]]]:
    """JointDNN's constrained scenarios as a MILP over the layer graph (nodes (b, X); run edges
    (b, X) -> (b + 1, X); switch edges (b, X) -> (b, Y) at inner boundaries)."""
    L = c.num_layers
    edges = []  # (kind, b, x, y): "start" (0, x), "run" layer b on x, "switch" at boundary b from x to y
    for x in (0, 1):
        edges.append(("start", 0, x, x))
    for b in range(L):
        for x in (0, 1):
            edges.append(("run", b, x, x))
    for b in range(1, L):
        for x in (0, 1):
            edges.append(("switch", b, x, 1 - x))
    lat = np.zeros(len(edges))
    energy = np.zeros(len(edges))
    cloud = np.zeros(len(edges))
    node = {}  # (b, x) -> index

    def nid(b, x):
        return node.setdefault((b, x), len(node))

    head, tail = [], []  # edge goes tail -> head
    for k, (kind, b, x, y) in enumerate(edges):
        if kind == "start":
            lat[k], energy[k] = c.upload[x], c.energy_upload[x]
            tail.append(None)
            head.append(nid(0, x))
        elif kind == "run":
            lat[k], energy[k] = c.compute[x, b], c.energy_compute[x, b]
            cloud[k] = c.compute[x, b] if x == 1 else 0.0
            tail.append(nid(b, x))
            head.append(nid(b + 1, x))
        else:
            lat[k], energy[k] = c.cross[x, b], c.energy_cross[x, b]
            tail.append(nid(b, x))
            head.append(nid(b, y))
    n_nodes = len(node)
    flow = np.zeros((n_nodes, len(edges)))
    for k in range(len(edges)):
        if tail[k] is not None:
            flow[tail[k], k] -= 1
        flow[head[k], k] += 1
    supply = np.zeros(n_nodes)
    for x in (0, 1):
        supply[nid(L, x)] = np.nan  # sinks: one unit leaves from either end node
    inner = ~np.isnan(supply)
    constraints = [LinearConstraint(flow[inner], 0, 0),  # conservation at inner nodes
                   LinearConstraint(np.array([[1.0 if e[0] == "start" else 0.0 for e in edges]]), 1, 1)]
    if objective == "battery":
        cost, side = lat, energy
    elif objective == "cloud":
        cost, side = lat, cloud
    elif objective == "qos":
        cost, side = energy, lat
    else:
        raise ValueError(f"unknown constraint '{objective}': use battery, cloud or qos")
    constraints.append(LinearConstraint(side[None, :], -np.inf, budget))
    res = milp(cost, constraints=constraints, integrality=np.ones(len(edges)), bounds=Bounds(0, 1))
    if res.status != 0 or res.x is None:
        what = {"battery": "mobile energy", "cloud": "cloud compute time", "qos": "latency"}[objective]
        raise NoPlan(f"no placement keeps the {what} within {budget:g} ({res.message})")
    chosen = res.x > 0.5
    placement = [None] * L
    for k, (kind, b, x, _) in enumerate(edges):
        if chosen[k] and kind == "run":
            placement[b] = x
    if any(p is None for p in placement):
        raise NoPlan("the integer program returned a path that skips layers")
    return float(cost @ res.x), merge_groups([(b, b + 1, x) for b, x in enumerate(placement)])


def plan_jointdnn(inputs: PlanInputs, mobile: str | None = None, cloud: str | None = None,
                  objective: str = "latency", budget: float | None = None) -> Plan:
    """The best two-party placement. The mobile is the data source (else the first device);
    the cloud is the given device, or whichever other device gives the shortest path."""
    cl = inputs.cluster
    mobile = mobile or cl.data_source or cl.names[0]
    others = [cloud] if cloud else [n for n in cl.names if n != mobile]
    best = None
    for other in others or [mobile]:
        costs = two_party_costs(inputs, mobile, other)
        if objective == "latency":
            value, groups = shortest_path(costs)
        elif objective == "energy":
            value, groups = shortest_path(costs, (0.0, 1.0))
        else:
            if budget is None:
                raise NoPlan(f"the '{objective}' form of jointdnn needs a budget")
            try:
                value, groups = constrained_path(costs, objective, budget)
            except NoPlan:
                continue
        if best is None or value < best[0]:
            best = (value, groups, costs.parties)
    if best is None:
        raise NoPlan(f"no two-party placement meets the {objective} budget {budget:g}")
    _, groups, parties = best
    stages = [Stage(i, j, "single", [parties[x]]) for i, j, x in groups]
    plan = inputs.plan(stages, "jointdnn" if objective == "latency" else f"jointdnn-{objective}")
    return inputs.finish(plan)
