"""`swarm plan` on the live swarm: agents in one trio loop on 127.0.0.1 profile themselves
as a job, the links between them are measured, and the planner gets a Cluster."""
from __future__ import annotations

import numpy as np
import pytest
import trio

from planner.inputs import PlanInputs
from planner.memory import JOB_BYTES, MemoryModel
from planner.planners import make_plan
from swarm.agent import Agent, AgentConfig, register_job_kind
from swarm.host.resources import cpu_quota, default_reserve
from swarm.net import Credentials, resolve_network
from swarm.profiling import bandwidth
from swarm.profiling.cache import read_profile
from swarm.profiling.profiler import PROFILE_JOB, run_profile_job
from swarm.profiling.survey import cluster_from_live, gather_live
from swarm.zoo import describe_model

pytestmark = pytest.mark.trio

TOKEN = "plan-test-token-" + "z" * 20


async def test_live_swarm_is_profiled_and_planned(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_STATE_DIR", str(tmp_path))  # where the agents cache their profiles
    # The message bursts' work between round trips, made large enough that counting it in the
    # CPU per message or per byte would show (below): 24 round trips each with 50 ms between.
    monkeypatch.setattr(bandwidth, "MESSAGE_GAP_S", 0.05)
    register_job_kind(PROFILE_JOB, run_profile_job)  # (agents started by `swarm join` register it by name)
    network = resolve_network("lo")
    spec = {"model": "lenet5", "img_size": None, "classes": None, "cfg": None, "batch_sizes": [1, 2], "repeats": 1,
            "threads": 1}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            agents = []
            for i in range(2):
                config = AgentConfig(name=f"dev{i}", node_id=f"node{i}", token=TOKEN, network=network, port=0,
                                     advertise=False, memory=2**31, accelerator="cpu")  # the host's memory
                agents.append(await nursery.start(Agent(config).run))
            peers = [("127.0.0.1", a.port) for a in agents]
            live = await gather_live(Credentials("coordinator", TOKEN), network, peers, spec, 0.5, discover=False)
            nursery.cancel_scope.cancel()
    desc = describe_model("lenet5")
    cluster = cluster_from_live(live, desc)
    assert sorted(cluster.names) == ["dev0", "dev1"]
    assert cluster.bw("dev0", "dev1") > 0 and cluster.latency > 0
    # each end's CPU per byte moved, without the bursts' work: 4.4-6.4 ns here (2026-11-30), 83 ns
    # with it (it was counted in the process's CPU over the probe bytes)
    assert all(0 < d.comm_s_per_byte < 3e-8 for d in cluster.devices)
    # and a gradient share's on a lane of its own, where the runs' sums go: under the event loop's a byte
    assert all(0 < d.lane_s_per_byte < d.comm_s_per_byte and 0 <= d.lane_msg_s < 1e-3 for d in cluster.devices)
    quota = min(1.0, cpu_quota() or 1.0)
    for r in live["links"].values():  # CPU per message; what it adds to the latency under a quota
        # (timed with the sender's thread working MESSAGE_GAP_S between round trips, which is
        # not the messages': counted, it would add MESSAGE_GAP_S / 2 to each)
        assert 0 < r["msg_cpu_s"]["from"] < bandwidth.MESSAGE_GAP_S / 2
        assert r["msg_s"]["from"] == pytest.approx(r["msg_cpu_s"]["from"] * (1 / quota - 1))
    profile = live["profiles"]["node0"]
    # the sum's own work a message, measured with the profile, kept in the cache and planned on
    assert 0 < profile.device["reduce_msg_cpu_s"] < 0.01
    assert cluster.device("dev0").reduce_msg_s == pytest.approx(profile.device["reduce_msg_cpu_s"] / quota)
    cached = [read_profile(p) for p in tmp_path.rglob("*.json") if "lenet5" in p.name]
    assert cached and all("reduce_msg_cpu_s" in c.device for c in cached)
    # planned on what the device could spare after profiling (within its 2 GiB less the default reserve)
    spare = next(d["spare"] for d in live["devices"] if d["name"] == "dev0")
    assert 0 < spare <= 2**31 - default_reserve(2**31)
    assert cluster.device("dev0").memory == pytest.approx(spare - profile.runtime_bytes - JOB_BYTES)
    plan = make_plan("dp", PlanInputs(desc, MemoryModel(desc, profile.act_bytes), cluster, 8, 2))
    assert plan.predicted["fits"] and set(plan.used_devices()) <= {"dev0", "dev1"}


async def test_an_advertised_accelerator_reaches_the_profile_and_the_plan(tmp_path, monkeypatch):
    """dev0's agent offers cuda, dev1's opts out (`swarm join --accelerator cpu` on a GPU
    device): the profile jobs are asked for those, dev0's is taken on cuda (a stand-in
    profile here: no GPU, so torch is told it sees one and the measuring is replaced), and
    the plan says dev0's parts compute on cuda, dev1's on its CPU."""
    import torch

    from types import SimpleNamespace

    from planner.plan import Plan
    from swarm.execution.launch import SwarmOptions, SwarmRunner
    from swarm.local.compute_device import plan_device
    from swarm.local.trainer import TrainConfig
    from swarm.profiling import profiler

    monkeypatch.setenv("SWARM_STATE_DIR", str(tmp_path))
    register_job_kind(PROFILE_JOB, run_profile_job)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    measured = profiler.profile_model("lenet5", None, batch_sizes=(1, 2), repeats=1, threads=1)
    asked = []

    def stand_in(model, *args, accelerator="cpu", **kw):
        asked.append(accelerator)
        profile = profiler.DeviceProfile.from_dict(measured.to_dict())
        if accelerator == "cuda":
            profile.costs = profile.costs.scaled(20.0)
            profile.device["accelerator"] = {"kind": "cuda", "note": "a GPU", "shared_memory": True, "copy_gbps": 4.0}
        return profile, False, tmp_path / "unused.json"

    monkeypatch.setattr(profiler, "load_or_profile", stand_in)
    network = resolve_network("lo")
    spec = {"model": "lenet5", "img_size": None, "classes": None, "cfg": None, "threads": 1}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            agents = []
            for i, offered in enumerate(("cuda", "cpu")):
                config = AgentConfig(name=f"dev{i}", node_id=f"node{i}", token=TOKEN, network=network, port=0,
                                     advertise=False, memory=2**31, accelerator=offered)
                agents.append(await nursery.start(Agent(config).run))
            peers = [("127.0.0.1", a.port) for a in agents]
            live = await gather_live(Credentials("coordinator", TOKEN), network, peers, spec, 0.5, discover=False)
            nursery.cancel_scope.cancel()
    assert sorted(asked) == ["cpu", "cuda"]
    desc = describe_model("lenet5")
    cluster = cluster_from_live(live, desc)
    gpu = cluster.device("dev0")
    assert gpu.accelerator.kind == "cuda" and gpu.accelerator.copy_s_per_byte == pytest.approx(1 / 4e9)
    assert gpu.memory == gpu.cpu_memory  # one memory with its CPU: counted once
    assert cluster.device("dev1").accelerator is None and cluster.accelerated == ["dev0"]
    plan = make_plan("pp", PlanInputs(desc, MemoryModel(desc, measured.act_bytes), cluster, 8, 2))
    again = Plan.from_json(plan.to_json())
    assert again.devices["dev0"]["accelerator"] == "cuda" and "accelerator" not in again.devices.get("dev1", {})
    # swarm train's own plan from the same measurements: the facts its workers place their work by
    runner = SwarmRunner(SwarmOptions(), log=lambda *a: None, fallback=None)
    trainer = SimpleNamespace(cfg=TrainConfig(model="lenet5", batch_size=8, microbatches=2), desc=desc)
    found = {d["name"]: SimpleNamespace(cores=d["cores"], memory=d["memory"], address=d["address"], port=d["port"])
             for d in live["devices"]}
    trained = runner._make_plan(trainer, sorted(found), found, live)
    assert "dev0" in trained.used_devices() and trained.devices["dev0"]["accelerator"] == "cuda"
    assert all(plan_device(trained.devices[n]).type == "cpu" for n in trained.used_devices() if n != "dev0")


async def test_a_device_is_charged_its_runtimes_cpu_each_step():
    """The runtime's own CPU in a step (RUNTIME_STEP_CPU_S) is spread over a device's quota: a
    fifth of a core takes five times as long for it as a whole core or more; its costs stay
    its profile's. The simulator charges it once a step, in the device's idle time if it has
    some, else on top of its computations."""
    from planner.cluster import Cluster, Device
    from planner.costs import CostTable
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel
    from planner.plan import Plan, Stage
    from swarm.profiling.survey import RUNTIME_STEP_CPU_S, runtime_step_time
    from swarm.zoo import describe_model

    assert runtime_step_time({"cpu_quota": 0.2, "cores": 1}) == pytest.approx(5 * RUNTIME_STEP_CPU_S)
    assert runtime_step_time({"cpu_quota": None, "cores": 4}) == pytest.approx(RUNTIME_STEP_CPU_S)
    desc = describe_model("lenet5", None)
    n = len(desc.layers)
    table = CostTable((1,), np.full(n, 0.1), np.full(n, 0.2), np.zeros(n), [0.0], [0.0])
    plan = Plan("lenet5", desc.img_size.width, 4, 4, [Stage(0, n, "single", ["a"])])
    steps = []
    for step_s in (0.0, 0.5):
        cluster = Cluster([Device("a", table, 2**30, step_s=step_s)], np.full((1, 1), 1e9), 0.0)
        steps.append(PlanInputs(desc, MemoryModel.estimated(desc), cluster, 4, 4).simulate(plan).step_time)
    assert steps[1] == pytest.approx(steps[0] + 0.5)


async def test_a_device_lost_while_profiling_is_profiled_again_not_planned_by_flops(monkeypatch):
    """A device on a small CPU share can miss a probe while it profiles; it is back at its
    next heartbeat. The run measures again rather than falling back to a split by FLOPs (a
    plan that knows nothing of the devices' memory); only a device that stays lost does that."""
    from types import SimpleNamespace

    from swarm.cluster import JobError
    from swarm.execution import launch

    calls = []

    async def profile_devices(cluster, ids, spec, accelerators=None):
        calls.append(list(ids))
        if len(calls) <= failures:
            raise JobError("dev0 was lost during job profile-1: no answer to a probe within 2 s")
        return {i: f"profile of {i}" for i in ids}

    async def measure_bandwidth(cluster, ids):
        return {"links": len(ids)}

    async def wait_for(count, timeout):
        return []

    monkeypatch.setattr(launch, "profile_devices", profile_devices)
    monkeypatch.setattr(launch, "measure_bandwidth", measure_bandwidth)
    monkeypatch.setattr(launch, "MEASURE_RETRY_WAIT_S", 0.0)
    devices = [SimpleNamespace(node_id=f"n{i}", accelerator="cpu", as_dict=lambda i=i: {"name": f"dev{i}"})
               for i in range(2)]
    trainer = SimpleNamespace(cfg=SimpleNamespace(model="yolov2-16", classes=None),
                              desc=SimpleNamespace(img_size=SimpleNamespace(to_json=lambda: 64)))
    cluster = SimpleNamespace(wait_for=wait_for)
    for failures, profiled in ((1, True), (launch.MEASURE_TRIES, False)):
        calls.clear()
        lines = []
        measured = await launch.SwarmRunner(launch.SwarmOptions(), lines.append, None)._measure(cluster, trainer, devices)
        if profiled:
            assert measured["profiles"] == {"n0": "profile of n0", "n1": "profile of n1"}
            assert len(calls) == 2 and any("trying again" in line for line in lines), lines
        else:
            assert measured is None and len(calls) == launch.MEASURE_TRIES
            assert "planning on estimates instead" in lines[-1], lines


async def test_a_model_no_device_can_profile_is_planned_on_estimates_within_memory(monkeypatch):
    """A device that cannot measure the model even in pieces (one of its layers alone is too
    big for it) says so, once: the run does not profile again, and plans on estimates
    (compute by cores, nominal links) within each device's memory. For the full yolov2 at
    416 on eight 1 GiB devices that is a pipeline over every device (tiles over the front and
    a pipeline behind, or replicated stages), which fits; the split by FLOPs it used to fall
    back on needs more than a device has."""
    from types import SimpleNamespace

    from planner.baselines import simple_plan
    from planner.memory_fit import memory_overflows
    from swarm.cluster import JobError
    from swarm.execution import launch

    calls = []

    async def profile_devices(cluster, ids, spec, accelerators=None):
        calls.append(list(ids))
        raise JobError("dev3 failed job profile-1: this device cannot profile the model: layer 23 alone on 1 "
                       "sample would need about 1190 MiB of this device's 1024 MiB")

    monkeypatch.setattr(launch, "profile_devices", profile_devices)
    desc = describe_model("yolov2", 416)
    names = [f"dev{i}" for i in range(8)]
    devices = [SimpleNamespace(node_id=f"n{i}", accelerator="cpu", as_dict=dict) for i in range(8)]
    trainer = SimpleNamespace(cfg=SimpleNamespace(model="yolov2", classes=None, optimizer="sgd", batch_size=8,
                                                  microbatches=8), desc=desc)
    lines = []
    runner = launch.SwarmRunner(launch.SwarmOptions(), lines.append, None)
    assert await runner._measure(SimpleNamespace(), trainer, devices) is None
    assert len(calls) == 1 and "planning on estimates instead" in lines[-1], lines

    facts = {n: {"cores": 1, "memory": 2**30, "address": f"10.0.0.{i}:4750"} for i, n in enumerate(names)}
    plan = runner._auto_plan(trainer, names, facts, None)
    memory = {n: 2**30 for n in names}
    assert memory_overflows(plan, desc, memory, "sgd") == []
    assert sorted(plan.used_devices()) == names and len(plan.stages) > 1
    assert memory_overflows(simple_plan("tiles", desc, names, 8, 8, facts=facts), desc, memory, "sgd")
