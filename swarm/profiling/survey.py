"""The planner's picture of the live swarm: find the agents, profile each (a job on every
agent, cached there), measure every link, and turn what was found into a planner Cluster.

    live = await gather_live(credentials, network, peers, spec, wait=2.0)
    cluster = cluster_from_live(live, desc)       # planner.cluster.Cluster, plain data
    cluster = estimated_cluster(facts, desc)      # without profiles: estimates from each device's facts
"""
from __future__ import annotations

from swarm.errors import SwarmError


async def gather_live(credentials, network, peers, spec: dict, wait: float, say=lambda text: None,
                      discover: bool = True, accelerators: bool = True):
    """Discover the swarm, profile every alive device (on the accelerator it offers; with
    `accelerators` off, on its CPU), measure every pair (None: nobody there); `say` hears
    what is going on. When a device cannot measure the model even in pieces, "profiles"
    is None and "why" says so: plan on estimates (estimated_cluster)."""
    import trio

    from swarm.cluster import open_roster
    from swarm.cluster.membership import BUSY_PROBE_TIMEOUT, BUSY_SUSPECT_AFTER
    from swarm.profiling.bandwidth import measure_bandwidth
    from swarm.profiling.profiler import CANNOT_PROFILE, profile_devices

    # profiling keeps each device busy: as tolerant of a late heartbeat as training is
    async with open_roster(credentials, network, peers=peers, discover=discover, suspect_after=BUSY_SUSPECT_AFTER,
                            probe_timeout=BUSY_PROBE_TIMEOUT) as cluster:
        await trio.sleep(wait)
        devices = cluster.alive()
        if not devices:
            return None
        say(f"found {len(devices)} device(s): {', '.join(d.name for d in devices)}; profiling each (cached there "
            "after the first time) and measuring the links")
        ids = [d.node_id for d in devices]
        try:
            profiles = await profile_devices(cluster, ids, spec,
                                             accelerators=offered_accelerators(devices, accelerators))
        except SwarmError as exc:
            if CANNOT_PROFILE not in str(exc):
                raise
            await cluster.refresh(ids)
            return {"devices": [d.as_dict() for d in devices], "profiles": None, "links": {}, "why": str(exc)}
        links = await measure_bandwidth(cluster, ids) if len(ids) > 1 else {}
        await cluster.refresh(ids)  # what each can spare now, after the profiling
        return {"devices": [d.as_dict() for d in devices], "profiles": profiles, "links": links}


def offered_accelerators(devices, use: bool = True) -> dict[str, str]:
    """{node id: the accelerator its agent offers} for the profile jobs ("cpu" for all when not `use`)."""
    return {d.node_id: d.accelerator if use and d.accelerator == "cuda" else "cpu" for d in devices}


def _end_cost(node: str, links: dict, key: str) -> float:
    """A device's cost `key` (comm_s_per_byte, msg_s, lane_s_per_byte, ...), as its end of the link measurements
    found it."""
    for (a, b), r in links.items():
        ends = r.get(key) or {}
        if node in (a, b) and ends:
            return float(ends["from"] if node == a else ends["to"])
    return 0.0


# The CPU a device's own runtime spends in a step beyond what the measured per-message and
# per-byte costs charge (msg_s, comm_s_per_byte; a gradient sum's on lanes: lane_s_per_byte,
# lane_msg_s): the event loop's turns, timers, heartbeats, the step's messages with the
# coordinator and its bookkeeping, in the same process as the computation and so out of the
# same CPU quota. It goes with the step, not with its length: on the testbed (yolov2-16 at 416,
# sums on lanes; bench/RESULTS.md, 2026-12-05 09:09-10:09) a process took, beyond its compute
# thread's CPU and what its lanes' costs charge for the sum, 0.038-0.055 CPU-s in steps of 3.3-3.6 s
# (8 x 0.2 core, batch 8) and 0.040-0.073 in steps of 12.6-13.6 s (the mixed swarm, batch 32; up to
# 0.10 on the device running four micro-batches and on the 0.1-core pair exchanging BatchNorm
# sums). The planner charges each device this much a step, over its quota (Device.step_s).
# (Charged instead as a share of the quota's cores, 0.022 then 0.009, it was a fifth of a
# 0.1-core device's quota, and a plan that used two of them was predicted 24% slower than it ran.)
RUNTIME_STEP_CPU_S = 0.06


def runtime_step_time(device: dict) -> float:
    """A device's time each step for its runtime's own CPU (RUNTIME_STEP_CPU_S), spread over its
    CPU quota where that is below a core; on an accelerator, over the core that drives it."""
    return RUNTIME_STEP_CPU_S / _core_share(device)


def _core_share(facts: dict) -> float:
    """The share of a core a device's profile facts give it: its CPU quota where that is below
    a core, else 1 (what it measured at full speed is spread over this)."""
    quota = facts.get("cpu_quota")
    return min(1.0, float(quota)) if quota else 1.0


def reduce_msg_time(facts: dict) -> float:
    """A device's time per message of a gradient sum beyond the message's own handling: the
    sum's work its profile measured at full speed (swarm.profiling.reduction), spread over its
    CPU quota where that is below a core."""
    return float(facts.get("reduce_msg_cpu_s") or 0.0) / _core_share(facts)


def map_time(facts: dict) -> float:
    """A device's time per byte of a block mapped afresh (planner.mapping): what its profile
    measured at full speed (swarm.host.malloc.map_cost), spread over its CPU quota where that
    is below a core; 0 where it cannot map."""
    return float(facts.get("map_cpu_s_per_byte") or 0.0) / _core_share(facts)


def plan_memory(device: dict) -> int:
    """The memory a plan may count on of a device as the roster saw it (Member's fields): what it
    can spare, where it said (swarm/host/resources.py; at least 1 byte, as 0 reads as not known),
    else all of it."""
    spare = device.get("spare")
    return max(1, int(spare)) if spare is not None else int(device.get("memory") or 0)


def cluster_from_live(live: dict, desc):
    """A planner Cluster from what gather_live found: each device's measured costs, what it can
    spare less the runtime's memory, its time per byte and per message moved (and per message of
    a gradient sum, reduce_msg_time), the measured pairwise
    rates, and half the median round trip of an empty message. A device profiled on an
    accelerator is planned on it (its profile's "accelerator": the copy rate, and its own
    memory or the device's, shared)."""
    import statistics
    from dataclasses import replace

    from planner.cluster import Cluster, ClusterError, Device, accelerator_from_dict, bandwidth_matrix
    from planner.memory import JOB_BYTES
    from planner.profile import ProfileError

    names, devices = {}, []
    for d in live["devices"]:
        profile = live["profiles"][d["node_id"]]
        try:
            profile.check_matches(desc)
        except ProfileError as exc:
            raise SwarmError(str(exc)) from None
        name = d["name"] if d["name"] not in names.values() else f"{d['name']}@{d['address']}"
        names[d["node_id"]] = name
        memory = plan_memory(d) or int(profile.device.get("memory") or 0)
        budget = max(0.0, memory - profile.runtime_bytes - JOB_BYTES)
        facts = {"cores": d["cores"], "address": d["address"], "spare": memory}
        if profile.device.get("allocator"):
            facts["allocator"] = profile.device["allocator"]  # the memory model's slack
        device = Device(name, profile.costs, budget, facts=facts, step_s=runtime_step_time(profile.device),
                        comm_s_per_byte=_end_cost(d["node_id"], live["links"], "comm_s_per_byte"),
                        msg_s=_end_cost(d["node_id"], live["links"], "msg_s"),
                        reduce_msg_s=reduce_msg_time(profile.device), map_s_per_byte=map_time(profile.device),
                        lane_s_per_byte=_end_cost(d["node_id"], live["links"], "lane_s_per_byte"),
                        lane_msg_s=_end_cost(d["node_id"], live["links"], "lane_msg_s"))
        entry = profile.device.get("accelerator")
        if entry:
            try:
                accelerator = accelerator_from_dict(entry, f"the profile of {name}: accelerator")
            except ClusterError as exc:
                raise SwarmError(str(exc)) from None
            own = budget if accelerator.shared_memory else max(0.0, float(entry.get("memory") or 0) - JOB_BYTES)
            device = replace(device, memory=own, accelerator=accelerator, cpu_memory=budget)
        devices.append(device)
    rates = {(names[a], names[b]): r["bytes_per_second"] for (a, b), r in live["links"].items()}
    order = [dev.name for dev in devices]
    bw = bandwidth_matrix(order, rates) if len(order) > 1 else [[float("inf")]]
    latency = statistics.median(r["latency"] for r in live["links"].values()) / 2 if live["links"] else 0.0
    return Cluster(devices, bw, latency, None, "swarm")


# Without profiles (a device that cannot measure the model even in pieces, or profiling that
# failed): each core is taken to compute this many GFLOP/s and each link to carry this many
# bytes a second. Only the devices' relative speeds and the share of time that moving data
# takes shape a plan; what they must not miss is memory, which is planned as always.
ESTIMATED_GFLOPS_PER_CORE = 2.0
ESTIMATED_LINK_BYTES_S = 100e6 / 8
ESTIMATED_LATENCY_S = 1e-3


def estimated_cluster(facts: dict[str, dict], desc):
    """A planner Cluster from the devices' own facts ({name: {"cores", "memory", "spare"}}, as
    agents report them) alone: compute from FLOPs at ESTIMATED_GFLOPS_PER_CORE a core, what each
    device can spare less the runtime's memory, and nominal links."""
    import numpy as np

    from planner.cluster import Cluster, Device
    from planner.costs import CostTable
    from planner.memory import JOB_BYTES
    from planner.memory_fit import RUNTIME_FLOOR

    devices = []
    for name, f in facts.items():
        costs = CostTable.from_flops(desc, ESTIMATED_GFLOPS_PER_CORE * max(1, int(f.get("cores") or 1)))
        memory = plan_memory(f)
        budget = max(0.0, memory - RUNTIME_FLOOR - JOB_BYTES)
        devices.append(Device(name, costs, budget, facts={"cores": f.get("cores"), "spare": memory}))
    n = len(devices)
    bandwidth = np.full((n, n), ESTIMATED_LINK_BYTES_S)
    np.fill_diagonal(bandwidth, np.inf)
    return Cluster(devices, bandwidth, ESTIMATED_LATENCY_S, None, "estimates")
