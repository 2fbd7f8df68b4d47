"""Devices that compute on an accelerator: the cluster file's "accelerator", the host<->accelerator
copies, its memory budget (shared with the host or its own), plans that say where each device
computes, and the Pi + Jetson example planned with and without its GPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cluster import ClusterError, cluster_from_dict
from planner.inputs import PlanInputs
from planner.memory import MemoryModel
from planner.plan import Plan, Stage
from planner.planners import STRATEGIES, make_plan
from planner.stage_work import ring_allreduce_time
from swarm.zoo import describe_model
from tests.conftest import run_swarm

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pi-jetson-cluster.json"
GiB = 2**30


@pytest.fixture(scope="module")
def desc():
    return describe_model("yolov2-16", 64)


def no_profiles(spec):
    raise AssertionError(f"unexpected profile {spec}")


def two_devices(accelerator: dict, cpu_memory: str = "2 GiB", mbps: float = 100) -> dict:
    return {"bandwidth_mbps": mbps, "data_source": "pi", "devices": [
        {"name": "pi", "memory": "3 GiB", "gflops": 5},
        {"name": "jetson", "memory": cpu_memory, "gflops": 4, "accelerator": accelerator}]}


JETSON_GPU = {"kind": "cuda", "gflops": 70, "mem_gbps": 12, "copy_gbps": 4, "memory": "1.5 GiB", "shared_memory": True}


# ---- the cluster file ------------------------------------------------------------------

def test_an_accelerator_gives_the_device_its_costs_and_memory_and_keeps_the_cpu_figures(desc):
    cl = cluster_from_dict(two_devices(JETSON_GPU), desc, no_profiles)
    jetson, pi = cl.device("jetson"), cl.device("pi")
    assert jetson.accelerator.kind == "cuda" and jetson.accelerator.shared_memory
    assert jetson.accelerator.copy_s_per_byte == pytest.approx(1 / 4e9)
    assert jetson.memory == 1.5 * GiB and jetson.cpu_memory == 2 * GiB
    gpu, cpu = jetson.costs.range_time(0, 17, 2), jetson.cpu_costs.range_time(0, 17, 2)
    assert cpu / gpu > 10  # 70 GFLOP/s against 4
    assert jetson.costs.source.startswith("cuda: 70 GFLOP/s")
    assert pi.accelerator is None and pi.cpu_costs is None and cl.accelerated == ["jetson"]
    on_cpu = cl.on_cpus().device("jetson")
    assert on_cpu.accelerator is None and on_cpu.memory == 2 * GiB
    assert on_cpu.costs.range_time(0, 17, 2) == pytest.approx(cpu)
    assert cl.device("jetson").accelerator is not None  # the original is left as it was


def test_an_accelerator_relative_to_the_reference(desc):
    data = two_devices({"kind": "cuda", "speed": 8, "copy_gbps": 4, "shared_memory": True})
    data["reference"] = {"gflops": 10}
    cl = cluster_from_dict(data, desc, no_profiles)
    ref = cl.device("jetson").costs.range_time(0, 17, 1)
    assert ref == pytest.approx(cluster_from_dict({"devices": [{"name": "r", "memory": "1 GiB", "gflops": 10}]},
                                                  desc, no_profiles).devices[0].costs.range_time(0, 17, 1) / 8)


def test_shared_memory_is_counted_once(desc):
    # the accelerator's budget is part of the device's memory: by default all of it, never more
    cl = cluster_from_dict(two_devices({"kind": "cuda", "gflops": 70, "copy_gbps": 4, "shared_memory": True}),
                           desc, no_profiles)
    assert cl.device("jetson").memory == 2 * GiB
    with pytest.raises(ClusterError, match="memory 3 GiB is more than the device's 2 GiB, which it shares"):
        cluster_from_dict(two_devices({**JETSON_GPU, "memory": "3 GiB"}), desc, no_profiles)


def test_a_discrete_gpu_has_its_own_budget(desc):
    gpu = {"kind": "cuda", "gflops": 5000, "mem_gbps": 400, "copy_gbps": 12, "memory": "8 GiB"}
    cl = cluster_from_dict(two_devices(gpu, cpu_memory="1 GiB"), desc, no_profiles)
    assert cl.device("jetson").memory == 8 * GiB and not cl.device("jetson").accelerator.shared_memory
    # a stage that fits the GPU's own memory but not the host's budget
    big = describe_model("yolov2-16", 416)
    cl = cluster_from_dict(two_devices(gpu, cpu_memory="300 MiB"), big, no_profiles)
    mem = MemoryModel.for_devices(big)
    for cluster, fits in ((cl, True), (cl.on_cpus(), False)):
        inputs = PlanInputs(big, mem, cluster, 4, 1)
        plan = inputs.finish(inputs.plan([Stage(0, 17, "single", ["jetson"])], "test"))
        timeline = inputs.simulate(plan)
        # a stage of the whole model keeps the job's reserve (MemoryModel.budget)
        assert timeline.budgets["jetson"] == (8 * GiB if fits else 300 * 2**20) + mem.whole_reserve
        assert timeline.fits is fits


@pytest.mark.parametrize("accelerator,message", [
    ("cuda", "device jetson: accelerator: expected an object"),
    ({**JETSON_GPU, "kind": "tpu"}, "device jetson: accelerator: \"kind\" must be one of cuda; got 'tpu'"),
    ({k: v for k, v in JETSON_GPU.items() if k != "kind"}, "\"kind\" must be one of cuda; got None"),
    ({k: v for k, v in JETSON_GPU.items() if k != "copy_gbps"}, "\"copy_gbps\" .* must be a positive number; got None"),
    ({**JETSON_GPU, "copy_gbps": 0}, "\"copy_gbps\" .* must be a positive number; got 0"),
    ({**JETSON_GPU, "copy_gbps": "fast"}, "\"copy_gbps\" .* got 'fast'"),
    ({**JETSON_GPU, "shared_memory": "yes"}, "\"shared_memory\" is true .* or false; got 'yes'"),
    ({**JETSON_GPU, "colour": "green"}, "device jetson: accelerator: unknown field\\(s\\) colour"),
    ({k: v for k, v in JETSON_GPU.items() if k != "gflops"}, "accelerator: give exactly one of \"speed\""),
    ({**JETSON_GPU, "speed": 3}, "accelerator: give exactly one of .*; got speed, gflops"),
    ({"kind": "cuda", "speed": 3, "copy_gbps": 4, "shared_memory": True}, "accelerator: \"speed\" is relative to"),
    ({**JETSON_GPU, "gflops": -1}, "device jetson: accelerator: gflops must be positive"),
    ({**JETSON_GPU, "memory": "lots"}, "device jetson: accelerator: memory: expected a size"),
    ({"kind": "cuda", "gflops": 70, "copy_gbps": 4},
     "accelerator: \"memory\" .* is missing; or \"shared_memory\": true"),
])
def test_accelerator_mistakes_are_one_line_naming_the_field(desc, accelerator, message):
    with pytest.raises(ClusterError, match=message) as err:
        cluster_from_dict(two_devices(accelerator), desc, no_profiles)
    assert "\n" not in str(err.value)


# ---- the copies ------------------------------------------------------------------------

def test_a_message_is_copied_once_at_each_accelerator_end(desc):
    cl = cluster_from_dict(two_devices({**JETSON_GPU, "copy_gbps": 0.5}, mbps=80), desc, no_profiles)
    nbytes = 1e6
    assert cl.transfer_time("pi", "jetson", nbytes) == pytest.approx(0.1 + nbytes / 0.5e9)
    assert cl.transfer_time("jetson", "pi", nbytes) == pytest.approx(0.1 + nbytes / 0.5e9)
    assert cl.on_cpus().transfer_time("pi", "jetson", nbytes) == pytest.approx(0.1)
    assert cl.transfer_time("jetson", "jetson", nbytes) == 0.0  # consecutive stages on one GPU hand over there
    # a ring over the group: the gradients to the host and the sums back
    plain = ring_allreduce_time(nbytes, ["pi", "jetson"], cl.on_cpus())
    assert ring_allreduce_time(nbytes, ["pi", "jetson"], cl) == pytest.approx(plain + 2 * nbytes / 0.5e9)


def test_the_simulator_charges_the_copies_where_a_stage_meets_another_device(desc):
    mem = MemoryModel.estimated(desc)
    steps = {}
    for rate in (1000.0, 0.01):  # GB/s: about free, and slow enough to see
        cl = cluster_from_dict(two_devices({**JETSON_GPU, "copy_gbps": rate}), desc, no_profiles)
        inputs = PlanInputs(desc, mem, cl, 2, 1)
        split = inputs.plan([Stage(0, 6, "single", ["pi"]), Stage(6, 17, "single", ["jetson"])], "test")
        alone = inputs.plan([Stage(0, 6, "single", ["jetson"]), Stage(6, 17, "single", ["jetson"])], "test")
        steps[rate] = inputs.simulate(split).step_time, inputs.simulate(alone).settled_s
    # activations in, gradients out: two copies of the boundary's bytes at the Jetson's end
    copies = 2 * 2 * mem.boundary(6)
    assert steps[0.01][0] - steps[1000.0][0] == pytest.approx(copies / 0.01e9 - copies / 1000e9, rel=1e-6)
    # both stages on the Jetson: the hand-off stays on it; only the images come in from the data
    # source (which the steps between settled ones take in while the step before runs)
    image = 2 * desc.input_bytes // 4
    assert steps[0.01][1] - steps[1000.0][1] == pytest.approx(image / 0.01e9 - image / 1000e9, rel=1e-6)


# ---- plans -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def example():
    big = describe_model("yolov2-16", 416)
    cl = cluster_from_dict(json.loads(EXAMPLE.read_text()), big, no_profiles)
    mem = MemoryModel.for_devices(big)
    return (PlanInputs(big, mem, cl, 8, 4), PlanInputs(big, mem, cl.on_cpus(), 8, 4))


def flops_on(plan: Plan, inputs: PlanInputs, device: str) -> float:
    """The share of the model's FLOPs a device runs (a split stage's by its samples or tiles)."""
    total = sum(layer.flops for layer in inputs.desc.layers)
    mine = 0.0
    for s in plan.stages:
        if device not in s.devices:
            continue
        layers = sum(layer.flops for layer in inputs.desc.layers[s.first:s.last])
        if s.mode == "dp" and s.allocation:
            mine += layers * s.allocation.get(device, 0) / sum(s.allocation.values())
        elif s.mode == "tiles":
            mine += layers * s.tile_devices.count(device) / len(s.tile_devices)
        else:
            mine += layers / max(1, s.replica_count())
    return mine / total


def test_the_example_trains_on_the_jetson_at_least_twice_as_fast(example):
    with_gpu, cpus_only = example
    assert with_gpu.cluster.accelerated == ["jetson-1"] and cpus_only.cluster.accelerated == []
    fast, slow = make_plan("auto", with_gpu), make_plan("auto", cpus_only)
    assert fast.predicted["fits"] and slow.predicted["fits"]
    assert slow.predicted["step_time_s"] >= 2 * fast.predicted["step_time_s"]
    assert flops_on(fast, with_gpu, "jetson-1") > 0.5  # the heavy layers run on the Jetson's GPU
    assert flops_on(slow, cpus_only, "jetson-1") < 0.5


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "local"])  # local: the data source, a Pi
def test_every_planner_sees_the_accelerator(example, strategy):
    with_gpu, cpus_only = example
    fast, slow = make_plan(strategy, with_gpu), make_plan(strategy, cpus_only)
    assert fast.predicted["step_time_s"] < slow.predicted["step_time_s"], strategy


def test_plans_say_where_each_device_computes_and_keep_it_through_json(example):
    with_gpu, cpus_only = example
    plan = make_plan("pp", with_gpu)  # every device in use
    assert plan.devices["jetson-1"]["accelerator"] == "cuda"
    assert plan.devices["jetson-1"]["memory"] == int(with_gpu.cluster.device("jetson-1").memory)
    assert all("accelerator" not in plan.devices[d] for d in ("pi-data", "pi-1", "pi-2"))
    again = Plan.from_json(plan.to_json())
    assert again.devices == plan.devices and again.devices["jetson-1"]["accelerator"] == "cuda"
    assert with_gpu.simulate(again).step_time == pytest.approx(plan.predicted["step_time_s"])
    assert "accelerator" not in make_plan("pp", cpus_only).devices["jetson-1"]


def test_swarm_plan_with_accelerators_on_and_off(tmp_path):
    steps = {}
    for setting in ("on", "off"):
        r = run_swarm("plan", "--model", "yolov2-16", "--devices", EXAMPLE, "--batch-size", "8", "--microbatches", "4",
                      "--accelerators", setting, "--json", cwd=tmp_path, env={"SWARM_STATE_DIR": str(tmp_path / "s")})
        assert r.returncode == 0, r.stderr
        plan = Plan.from_json(r.stdout)
        steps[setting] = plan.predicted["step_time_s"]
        assert any(f.get("accelerator") == "cuda" for f in plan.devices.values()) is (setting == "on")
    assert steps["off"] >= 2 * steps["on"]
    r = run_swarm("plan", "--devices", EXAMPLE, "--accelerators", "maybe", cwd=tmp_path)
    assert r.returncode == 2 and "--accelerators" in r.stderr and "Traceback" not in r.stderr


def test_a_plan_file_keeps_where_a_device_computes_if_its_agent_offers_it(example, tmp_path):
    """`swarm train --plan` with a plan `swarm plan --out` wrote for a Jetson: the Jetson's
    layers stay on its GPU when its agent offers cuda; an agent that offers only its CPU is a
    one-line error naming both, not a run on the wrong device."""
    from types import SimpleNamespace

    from swarm.errors import SwarmError
    from swarm.execution.launch import SwarmOptions, SwarmRunner
    from swarm.local.trainer import TrainConfig

    with_gpu, _ = example
    plan = make_plan("pp", with_gpu)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    runner = SwarmRunner(SwarmOptions(plan_path=str(path)), log=lambda *a: None, fallback=None)
    trainer = SimpleNamespace(cfg=TrainConfig(model="yolov2-16", batch_size=plan.batch_size,
                                              microbatches=plan.microbatches), desc=with_gpu.desc)

    def devices(jetson_offers):
        return {n: SimpleNamespace(cores=4, memory=2**32, address="10.0.0.9", port=4750,
                                   accelerator=jetson_offers if n == "jetson-1" else "cpu")
                for n in plan.used_devices()}

    ran = runner._make_plan(trainer, sorted(plan.used_devices()), devices("cuda"))
    assert ran.devices["jetson-1"]["accelerator"] == "cuda" and ran.devices["jetson-1"]["address"] == "10.0.0.9:4750"
    assert all("accelerator" not in ran.devices[d] for d in ran.used_devices() if d != "jetson-1")
    assert "jetson-1 (cuda)" in ran.describe() and "pi-1 (" not in ran.describe()
    with pytest.raises(SwarmError, match="puts jetson-1's layers on cuda, but its agent offers cpu"):
        runner._make_plan(trainer, sorted(plan.used_devices()), devices("cpu"))
