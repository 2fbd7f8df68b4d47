"""The devices a plan may use, as plain data: compute costs, memory budgets, bandwidths.

A cluster comes from the live swarm (profiles and a measured bandwidth matrix) or from a
hand-written description (docs/planner.md documents the JSON). Bandwidths are directional
bytes/s (an uplink can be slower than the downlink); latency is seconds per message.

A device with an accelerator (a Jetson's GPU) is planned on it: its `costs` and `memory` are
the accelerator's, every message it sends or receives is copied between host and
accelerator once at its end, and its CPU's own figures stay beside them
(`Cluster.on_cpus()` plans the same devices with their accelerators ignored).

    cluster = Cluster(devices=[Device("pi-1", table, memory=900 * 2**20), ...],
                      bandwidth=matrix_bytes_per_s, latency=0.0005, data_source="laptop")
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from planner.costs import CostTable
from planner.memory import ALLOCATORS
from planner.units import format_bytes, mbit_to_bytes_per_s, parse_bytes


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message says where and why."""


ACCELERATOR_KINDS = ("cuda",)


@dataclass(frozen=True)
class Accelerator:
    """Where a device computes when it is not its CPU, and what reaching it costs."""

    kind: str  # "cuda": what the runtime places the device's work on
    copy_s_per_byte: float  # seconds per byte copied between host and accelerator (either way)
    shared_memory: bool = False  # one memory for CPU and accelerator (a Jetson): its budget is counted once

    def copy_time(self, nbytes: float) -> float:
        return max(0.0, nbytes) * self.copy_s_per_byte


@dataclass
class Device:
    name: str
    costs: CostTable  # what the device computes at: its accelerator's when it has one
    memory: float  # bytes this device may spend on training (its budget u_d): its accelerator's when it has one
    tier: str | None = None  # "device" | "edge" | "cloud": HierTrain's roles, when given
    power_w: float | None = None  # compute power, for JointDNN's energy objective
    radio: dict | None = None  # JointDNN eq. 21: {"up_mw_per_mbps", "down_mw_per_mbps", "base_mw"}
    facts: dict = field(default_factory=dict)  # cores, cpu, ... as shown in plans
    # seconds of this device's time per byte it sends or receives: the CPU that moving data
    # costs (sockets, framing, copies), at the device's own speed and CPU quota. A link runs
    # at the slower of its bandwidth and its two ends' CPU.
    comm_s_per_byte: float = 0.0
    # seconds of this device's time per message it sends or receives, whatever its size
    # (framing, scheduling, waking threads), beyond what the cluster's latency (measured
    # between idle devices) includes: under a CPU quota a message's CPU is spread over
    # the quota like everything else. A message's one-way time is the latency plus both
    # ends' msg_s.
    msg_s: float = 0.0
    # seconds of this device's time per message of a gradient sum, beyond msg_s: the sum's own
    # work each round (a task per swap, the shape check, slicing and adding in), which a bare
    # message does not do (swarm.profiling.reduction measures it with the profile).
    reduce_msg_s: float = 0.0
    # seconds of this device's time per byte of a block mapped afresh and faulted in (the
    # kernel zeroes its pages): what a plan that maps its largest blocks costs it (planner.
    # mapping); 0: the device cannot map (its profile measures it on glibc as swarm starts it)
    map_s_per_byte: float = 0.0
    # seconds of this device's time per byte, and per share, of a gradient sum it sends or
    # receives on a lane of its own (swarm.execution.lane: groups of 2 to DIRECT_REDUCE_MAX
    # members), in place of comm_s_per_byte, msg_s and reduce_msg_s; measured by the bandwidth
    # probe (swarm.profiling.bandwidth). 0: not measured, and such sums are priced as the
    # event loop's
    lane_s_per_byte: float = 0.0
    lane_msg_s: float = 0.0
    # seconds of this device's time each step for its runtime's own work beyond what the
    # costs above charge (the event loop's turns, heartbeats, the step's messages with the
    # coordinator): swarm.profiling.survey.RUNTIME_STEP_CPU_S over its CPU quota. It comes out
    # of the device's idle time in the step, else delays its computations.
    step_s: float = 0.0
    accelerator: Accelerator | None = None  # None: the device computes on its CPU
    # the CPU's own figures when an accelerator is given (None: `costs` and `memory` are the CPU's)
    cpu_costs: CostTable | None = None
    cpu_memory: float | None = None

    def copy_time(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` of a message between host and accelerator at this end (0 on a CPU)."""
        return self.accelerator.copy_time(nbytes) if self.accelerator else 0.0

    def on_cpu(self) -> "Device":
        """The same device planned on its CPU alone."""
        if self.accelerator is None:
            return self
        return replace(self, costs=self.cpu_costs or self.costs,
                       memory=self.memory if self.cpu_memory is None else self.cpu_memory,
                       accelerator=None, cpu_costs=None, cpu_memory=None)

    def summary(self) -> dict:
        d = dict(self.facts)
        d.update(memory=int(self.memory), speed=self.costs.source)
        if self.accelerator:
            d["accelerator"] = self.accelerator.kind
        if self.tier:
            d["tier"] = self.tier
        return d


@dataclass
class Cluster:
    devices: list[Device]
    bandwidth: np.ndarray  # (N, N) bytes/s from row to column; the diagonal is unused
    latency: float = 0.0  # seconds added to every message
    data_source: str | None = None  # the device that holds the samples (None: every device has them)
    name: str = "cluster"
    recomputing: bool = False  # the devices' backward times include remaking BatchNorm (planner.recompute)
    checkpointing: bool = False  # the devices' backward times include a stage's forward again (planner.checkpoint)
    mapping: bool = False  # the devices' times include faulting their largest blocks in again (planner.mapping)
    # tolerance -> each device's class (planner/classes.py), worked out once per cluster
    class_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        names = [d.name for d in self.devices]
        if not names:
            raise ClusterError("a cluster needs at least one device")
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ClusterError(f"device name(s) used twice: {', '.join(dup)}")
        n = len(names)
        self.bandwidth = np.asarray(self.bandwidth, dtype=float)
        if self.bandwidth.shape != (n, n):
            raise ClusterError(f"the bandwidth matrix is {self.bandwidth.shape}, expected {n}x{n}")
        off = ~np.eye(n, dtype=bool)
        if n > 1 and not (self.bandwidth[off] > 0).all():
            raise ClusterError("every bandwidth between two devices must be positive")
        self.bandwidth[np.eye(n, dtype=bool)] = np.inf
        if self.data_source is not None and self.data_source not in names:
            raise ClusterError(f"data_source '{self.data_source}' is not a device; devices: {', '.join(names)}")
        self._index = {name: i for i, name in enumerate(names)}
        layers = {d.costs.num_layers for d in self.devices}
        if len(layers) > 1:
            raise ClusterError(f"the devices' cost tables cover different numbers of layers: {sorted(layers)}")

    # ---- lookups ---------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ClusterError(f"no device '{name}' in the cluster; devices: {', '.join(self.names)}") from None

    def device(self, name: str) -> Device:
        return self.devices[self.index(name)]

    def bw(self, a: str, b: str) -> float:
        return float(self.bandwidth[self._index[a], self._index[b]])

    def transfer_time(self, a: str, b: str, nbytes: float) -> float:
        """Seconds to move `nbytes` from a to b (nothing when they are the same device): the
        message over the link, and its copy out of a's accelerator and into b's, if any."""
        if a == b or nbytes <= 0:
            return 0.0
        da, db = self.device(a), self.device(b)
        cpu = max(da.comm_s_per_byte, db.comm_s_per_byte)
        copies = da.copy_time(nbytes) + db.copy_time(nbytes)
        return self.message_time(a, b) + nbytes * max(1 / self.bw(a, b), cpu) + copies

    def copy_per_byte(self, names: list[str]) -> float:
        """The largest seconds per byte copied between host and accelerator among a group (0: all on CPUs)."""
        return max((self.device(n).accelerator.copy_s_per_byte for n in names if self.device(n).accelerator),
                   default=0.0)

    def message_time(self, a: str, b: str) -> float:
        """One-way time of an empty message from a to b: the latency and both ends' extra handling."""
        return self.latency + self.device(a).msg_s + self.device(b).msg_s

    def comm_cpu(self, names: list[str]) -> float:
        """The largest seconds per byte moved among a group's devices (0: not measured)."""
        return max((self.device(n).comm_s_per_byte for n in names), default=0.0)

    def msg_cpu(self, names: list[str]) -> float:
        """The largest seconds per message handled among a group's devices (0: not measured)."""
        return max((self.device(n).msg_s for n in names), default=0.0)

    def reduce_msg_cpu(self, names: list[str]) -> float:
        """The largest seconds per message of a gradient sum among a group's devices: a message's
        handling and the sum's own work on it (0: not measured)."""
        return max((self.device(n).msg_s + self.device(n).reduce_msg_s for n in names), default=0.0)

    def lane_cpu(self, names: list[str]) -> tuple[float, float] | None:
        """(seconds per byte, per share) of a gradient sum on lanes among a group, the largest
        of each; None where a member's lanes are not measured (its sums are the event loop's)."""
        ends = [self.device(n) for n in names]
        if not all(d.lane_s_per_byte > 0 for d in ends):
            return None
        return max(d.lane_s_per_byte for d in ends), max(d.lane_msg_s for d in ends)

    def min_bw(self, names: list[str]) -> float:
        """The slowest link among a group: what a ring all-reduce runs at (Asteroid eq. 5)."""
        idx = [self._index[n] for n in names]
        if len(idx) < 2:
            return float("inf")
        sub = self.bandwidth[np.ix_(idx, idx)]
        return float(sub[~np.eye(len(idx), dtype=bool)].min())

    def reference_time(self, name: str, batch: int) -> float:
        """A device's time for one forward+backward of the whole model on `batch` samples."""
        costs = self.device(name).costs
        return costs.range_time(0, costs.num_layers, batch, with_loss=True)

    def by_speed(self, batch: int = 1) -> list[str]:
        """Device names, fastest first."""
        return sorted(self.names, key=lambda n: (self.reference_time(n, batch), self.index(n)))

    def subset(self, names: list[str]) -> "Cluster":
        idx = [self.index(n) for n in names]
        src = self.data_source if self.data_source in names else None
        return Cluster([self.devices[i] for i in idx], self.bandwidth[np.ix_(idx, idx)], self.latency, src, self.name,
                       recomputing=self.recomputing, checkpointing=self.checkpointing, mapping=self.mapping)

    def describe(self) -> dict:
        return {d.name: d.summary() for d in self.devices}

    @property
    def accelerated(self) -> list[str]:
        """The devices that compute on an accelerator."""
        return [d.name for d in self.devices if d.accelerator is not None]

    def on_cpus(self) -> "Cluster":
        """The same cluster with every accelerator ignored: each device planned on its CPU."""
        return Cluster([d.on_cpu() for d in self.devices], self.bandwidth.copy(), self.latency, self.data_source,
                       self.name, recomputing=self.recomputing, checkpointing=self.checkpointing, mapping=self.mapping)


# ---- the JSON description -------------------------------------------------------------

DEVICE_KEYS = {"name", "memory", "speed", "gflops", "mem_gbps", "profile", "tier", "power_w", "radio", "link_mbps",
               "cores", "note", "comm_ns_per_byte", "msg_us", "reduce_msg_us", "map_ns_per_byte", "lane_ns_per_byte", "lane_us", "accelerator",
               "allocator"}
ACCELERATOR_KEYS = {"kind", "speed", "gflops", "mem_gbps", "profile", "copy_gbps", "memory", "shared_memory", "note"}
CLUSTER_KEYS = {"name", "description", "reference", "data_source", "bandwidth_mbps", "latency_ms", "links", "devices",
                "note"}


def cluster_from_dict(d: dict, desc, resolve_profile) -> Cluster:
    """Build a Cluster from its JSON description for one model (docs/planner.md).

    `resolve_profile(spec)` turns "local", a path, or an inline profile object into a
    CostTable for `desc`; it is given by the caller, which may read files or profile this
    machine (the planner itself does neither)."""
    if not isinstance(d, dict):
        raise ClusterError("a cluster description is a JSON object")
    extra = set(d) - CLUSTER_KEYS
    if extra:
        raise ClusterError(f"unknown cluster field(s): {', '.join(sorted(extra))}; known: {', '.join(sorted(CLUSTER_KEYS))}")
    specs = d.get("devices")
    if not isinstance(specs, list) or not specs:
        raise ClusterError("the cluster lists no devices (\"devices\": [...])")
    reference = None
    if "reference" in d:
        ref = d["reference"]
        if isinstance(ref, dict) and "gflops" in ref:
            reference = CostTable.from_flops(desc, float(ref["gflops"]), ref.get("mem_gbps"))
        else:
            reference = resolve_profile(ref)
    devices, links_mbps = [], []
    for i, spec in enumerate(specs):
        devices.append(_device_from_dict(i, spec, desc, reference, resolve_profile))
        links_mbps.append(spec.get("link_mbps"))
    n = len(devices)
    names = [dev.name for dev in devices]
    twice = sorted({x for x in names if names.count(x) > 1})
    if twice:
        raise ClusterError(f"device name(s) used twice: {', '.join(twice)}")
    default = d.get("bandwidth_mbps")
    bw = np.full((n, n), float(default) if default is not None else np.inf)
    for i in range(n):
        for j in range(n):
            for cap in (links_mbps[i], links_mbps[j]):
                if cap is not None:
                    bw[i, j] = min(bw[i, j], float(cap))
    for k, link in enumerate(d.get("links") or []):
        _apply_link(k, link, names, bw)
    missing = [(names[i], names[j]) for i in range(n) for j in range(n) if i != j and not np.isfinite(bw[i, j])]
    if missing:
        a, b = missing[0]
        raise ClusterError(f"no bandwidth between {a} and {b}: give \"bandwidth_mbps\" for the cluster, "
                           "\"link_mbps\" for devices, or a \"links\" entry")
    try:
        return Cluster(devices, np.vectorize(mbit_to_bytes_per_s)(bw), float(d.get("latency_ms", 0.0)) / 1000,
                       d.get("data_source"), str(d.get("name", "cluster")))
    except ValueError as exc:
        raise ClusterError(str(exc)) from None


def _device_from_dict(i: int, spec, desc, reference, resolve_profile) -> Device:
    if not isinstance(spec, dict) or "name" not in spec:
        raise ClusterError(f"device {i}: each device needs at least a \"name\"")
    name = str(spec["name"])
    where = f"device {name}"
    extra = set(spec) - DEVICE_KEYS
    if extra:
        raise ClusterError(f"{where}: unknown field(s) {', '.join(sorted(extra))}; known: {', '.join(sorted(DEVICE_KEYS))}")
    try:
        costs = _costs_from_dict(spec, where, desc, reference, resolve_profile)
        if "memory" not in spec:
            raise ClusterError(f"{where}: \"memory\" (the bytes it may use for training, e.g. \"900 MiB\") is missing")
        memory = parse_bytes(spec["memory"], f"{where}: memory")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ClusterError):
            raise
        raise ClusterError(f"{where}: {exc}") from None
    facts = {k: spec[k] for k in ("cores", "note") if k in spec}
    if "allocator" in spec:
        if spec["allocator"] not in ALLOCATORS:
            raise ClusterError(f"{where}: allocator '{spec['allocator']}' is not one of {', '.join(ALLOCATORS)}")
        facts["allocator"] = spec["allocator"]
    comm = _non_negative(spec, "comm_ns_per_byte", "nanoseconds", where)
    msg = _non_negative(spec, "msg_us", "microseconds", where)
    reduce_msg = _non_negative(spec, "reduce_msg_us", "microseconds", where)
    map_cost = _non_negative(spec, "map_ns_per_byte", "nanoseconds", where)
    lane, lane_msg = _non_negative(spec, "lane_ns_per_byte", "nanoseconds", where), _non_negative(spec, "lane_us",
                                                                                                 "microseconds", where)
    device = Device(name, costs, memory, spec.get("tier"), spec.get("power_w"), spec.get("radio"), facts,
                    comm_s_per_byte=comm * 1e-9, msg_s=msg * 1e-6, reduce_msg_s=reduce_msg * 1e-6,
                    map_s_per_byte=map_cost * 1e-9, lane_s_per_byte=lane * 1e-9, lane_msg_s=lane_msg * 1e-6)
    if "accelerator" in spec:
        accelerator, acc_costs, acc_memory = _accelerator_from_dict(spec["accelerator"], memory, where, desc, reference,
                                                                    resolve_profile)
        device = replace(device, costs=acc_costs, memory=acc_memory, accelerator=accelerator, cpu_costs=costs,
                         cpu_memory=memory)
    return device


def _costs_from_dict(spec: dict, where: str, desc, reference, resolve_profile) -> CostTable:
    """A device's (or an accelerator's) cost table from exactly one of speed, gflops, profile."""
    given = [k for k in ("speed", "gflops", "profile") if k in spec]
    if len(given) != 1:
        raise ClusterError(f"{where}: give exactly one of \"speed\" (times the reference), \"gflops\" or \"profile\""
                           + (f"; got {', '.join(given)}" if given else ""))
    if "gflops" in spec:
        return CostTable.from_flops(desc, float(spec["gflops"]), spec.get("mem_gbps"))
    if "profile" in spec:
        return resolve_profile(spec["profile"])
    if reference is None:
        raise ClusterError(f"{where}: \"speed\" is relative to the cluster's \"reference\", which is missing "
                           "(\"reference\": \"local\", a profile file, or {\"gflops\": N})")
    return reference.scaled(float(spec["speed"]))


def _accelerator_from_dict(spec, host_memory: float, where: str, desc, reference, resolve_profile
                           ) -> tuple[Accelerator, CostTable, float]:
    """A device's "accelerator": (what it is, its cost table, the device's memory budget on it).

    Its memory is the budget for weights and activations on it: a discrete GPU's own (required),
    or, where it shares the host's memory (a Jetson), part of that one memory (default: all of
    the device's budget; never more, since the same bytes are not counted twice)."""
    where = f"{where}: accelerator"
    accelerator = accelerator_from_dict(spec, where)
    kind, shared = accelerator.kind, accelerator.shared_memory
    try:
        costs = _costs_from_dict(spec, where, desc, reference, resolve_profile)
        if "memory" in spec:
            memory = parse_bytes(spec["memory"], f"{where}: memory")
        elif shared:
            memory = host_memory
        else:
            raise ClusterError(f"{where}: \"memory\" (its own memory for training, e.g. \"7 GiB\") is missing; "
                               "or \"shared_memory\": true where it shares the device's")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ClusterError):
            raise
        raise ClusterError(f"{where}: {exc}") from None
    if shared and memory > host_memory:
        raise ClusterError(f"{where}: memory {format_bytes(memory)} is more than the device's "
                           f"{format_bytes(host_memory)}, which it shares (\"shared_memory\": true): give at most the device's memory")
    costs = replace(costs, source=f"{kind}: {costs.source}")
    return accelerator, costs, float(memory)


def accelerator_from_dict(spec, where: str) -> Accelerator:
    """What an "accelerator" entry says the accelerator is: its kind, copy rate and whether it
    shares the host's memory (a cluster file's, or a profile's as the profiler measured it)."""
    if not isinstance(spec, dict):
        raise ClusterError(f"{where}: expected an object such as {{\"kind\": \"cuda\", \"gflops\": 70, "
                           "\"copy_gbps\": 4, \"shared_memory\": true}")
    extra = set(spec) - ACCELERATOR_KEYS
    if extra:
        raise ClusterError(f"{where}: unknown field(s) {', '.join(sorted(extra))}; known: "
                           f"{', '.join(sorted(ACCELERATOR_KEYS))}")
    kind = spec.get("kind")
    if kind not in ACCELERATOR_KINDS:
        raise ClusterError(f"{where}: \"kind\" must be one of {', '.join(ACCELERATOR_KINDS)}; got {kind!r}")
    shared = spec.get("shared_memory", False)
    if not isinstance(shared, bool):
        raise ClusterError(f"{where}: \"shared_memory\" is true (one memory with the CPU, as on a Jetson) or false; "
                           f"got {shared!r}")
    copy = spec.get("copy_gbps")
    if not isinstance(copy, (int, float)) or isinstance(copy, bool) or not copy > 0:
        raise ClusterError(f"{where}: \"copy_gbps\" (the host<->accelerator copy rate, GB/s) must be a positive "
                           f"number; got {copy!r}")
    return Accelerator(kind, 1 / (float(copy) * 1e9), shared)


def _non_negative(spec: dict, key: str, unit: str, where: str) -> float:
    value = spec.get(key, 0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ClusterError(f"{where}: {key} must be a number of {unit}, 0 or more; got {value!r}")
    return float(value)


def _apply_link(k: int, link, names: list[str], bw: np.ndarray) -> None:
    if not isinstance(link, dict) or "mbps" not in link:
        raise ClusterError(f"link {k}: expected {{\"between\": [a, b], \"mbps\": N}} or {{\"from\": a, \"to\": b, \"mbps\": N}}")
    mbps = float(link["mbps"])
    if not mbps > 0:
        raise ClusterError(f"link {k}: mbps must be positive, got {mbps}")
    if "between" in link:
        pairs = [tuple(link["between"]), tuple(reversed(link["between"]))]
    elif "from" in link and "to" in link:
        pairs = [(link["from"], link["to"])]
    else:
        raise ClusterError(f"link {k}: give \"between\": [a, b] or \"from\" and \"to\"")
    for a, b in pairs:
        if a not in names or b not in names:
            raise ClusterError(f"link {k} names an unknown device ({a} or {b}); devices: {', '.join(names)}")
        bw[names.index(a), names.index(b)] = mbps


def bandwidth_matrix(names: list[str], measured: dict[tuple[str, str], float]) -> np.ndarray:
    """The seam for the live swarm: a matrix from measured {(from, to): bytes/s}. A pair
    measured in one direction only is taken to be symmetric."""
    n = len(names)
    bw = np.full((n, n), np.nan)
    idx = {name: i for i, name in enumerate(names)}
    for (a, b), rate in measured.items():
        bw[idx[a], idx[b]] = rate
    for i in range(n):
        for j in range(n):
            if i != j and np.isnan(bw[i, j]):
                if np.isnan(bw[j, i]):
                    raise ClusterError(f"no bandwidth measured between {names[i]} and {names[j]}")
                bw[i, j] = bw[j, i]
    np.fill_diagonal(bw, np.inf)
    return bw
