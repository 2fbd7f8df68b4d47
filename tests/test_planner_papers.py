"""The source papers' own scenarios: the planners reach the decisions the papers report.

JointDNN  training a discriminative CNN over Wi-Fi: mobile first, cloud after (the
          forward + mirrored backward path goes mobile-cloud-mobile); over 3G all on the
          mobile; larger batches favour the mobile (section 4).
HierTrain device/edge/cloud (section VI): cloud-heavy when edge-cloud is fast, edge-heavy
          when it is slow (Fig. 7, 11).
Asteroid  CNNs: data parallelism early, pipeline stages late; a model of tiny activations
          and large weights: a straight pipeline (section 2.3, Table 2).
Rama      compute-bound Raspberry Pis sync at every layer; fast GPUs prefer larger groups
          (sections 5.3, 5.4).
Compute rates the papers do not state are the assumptions written in the example cluster
files (and below); bandwidths are the papers'.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.asteroid import plan_asteroid
from planner.baselines import plan_local
from planner.cluster import cluster_from_dict
from planner.hiertrain import plan_hiertrain
from planner.inputs import PlanInputs
from planner.jointdnn import plan_jointdnn
from planner.memory import MemoryModel
from planner.plan import Stage
from planner.synthetic import flops_cluster
from planner.tiles_planner import plan_tiles
from swarm.zoo import describe_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str, desc, **changes):
    data = json.loads((EXAMPLES / f"{name}-cluster.json").read_text())
    data.update(changes)
    return cluster_from_dict(data, desc, lambda spec: pytest.fail(f"example needs a profile: {spec}"))


def inputs_for(desc, cluster, batch, micro=1):
    return PlanInputs(desc, MemoryModel.estimated(desc), cluster, batch, micro)


def placement(plan):
    return [(s.first, s.last, s.devices[0]) for s in plan.stages]


# ---- JointDNN ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def alexnet():
    return describe_model("alexnet", 227)


def test_jointdnn_wifi_training_goes_mobile_cloud_mobile(alexnet):
    inputs = inputs_for(alexnet, example("jointdnn-wifi", alexnet), batch=1)  # online training
    plan = plan_jointdnn(inputs)
    stages = placement(plan)
    assert [d for _, _, d in stages] == ["mobile", "cloud"]
    cut = stages[0][1]
    assert alexnet.layers[cut - 1].kind in ("maxpool", "conv")  # the feature extractor stays on the mobile
    # forward mobile -> cloud, backward cloud -> mobile: the mirrored path ends on the mobile
    timeline = inputs.simulate(plan)
    last_backward = max((e for e in timeline.events if e.kind == "B"), key=lambda e: e.end)
    assert last_backward.device == "mobile"
    for alone in ("mobile", "cloud"):
        assert plan.predicted["step_time_s"] < plan_local(inputs, alone).predicted["step_time_s"]


def test_jointdnn_3g_keeps_everything_on_the_mobile(alexnet):
    inputs = inputs_for(alexnet, example("jointdnn-3g", alexnet), batch=1)
    assert placement(plan_jointdnn(inputs)) == [(0, 13, "mobile")]


def test_jointdnn_larger_batches_favour_the_mobile(alexnet):
    inputs = inputs_for(alexnet, example("jointdnn-wifi", alexnet), batch=16)
    assert placement(plan_jointdnn(inputs)) == [(0, 13, "mobile")]


def test_jointdnn_energy_budget_trades_latency(alexnet):
    """The battery-constrained form: a budget below the latency-optimal plan's mobile energy."""
    from planner.jointdnn import shortest_path, two_party_costs

    inputs = inputs_for(alexnet, example("jointdnn-wifi", alexnet), batch=1)
    costs = two_party_costs(inputs, "mobile", "cloud")
    _, fastest = shortest_path(costs)
    _, frugal = shortest_path(costs, (0.0, 1.0))
    place = lambda groups: [x for i, j, x in groups for _ in range(i, j)]  # noqa: E731
    fast_energy = costs.path_costs(place(fastest))[1]
    least_energy = costs.path_costs(place(frugal))[1]
    assert least_energy < fast_energy
    budget = (fast_energy + least_energy) / 2
    plan = plan_jointdnn(inputs, objective="battery", budget=budget)
    chosen = [1 if s.devices[0] == "cloud" else 0 for s in plan.stages for _ in range(s.first, s.last)]
    assert costs.path_costs(chosen)[1] <= budget + 1e-9


# ---- HierTrain --------------------------------------------------------------------------

@pytest.mark.parametrize("edge_cloud_mbps,heavy", [(1.5, "edge"), (5, "cloud"), (50, "cloud")])
def test_hiertrain_cloud_heavy_when_the_link_is_fast(edge_cloud_mbps, heavy):
    desc = describe_model("alexnet", 96)  # the nearest size to tiny-ImageNet's 64x64 this AlexNet takes
    links = [{"between": ["device", "edge"], "mbps": 5},
             {"between": ["edge", "cloud"], "mbps": edge_cloud_mbps},
             {"between": ["device", "cloud"], "mbps": min(5, edge_cloud_mbps)}]  # through the edge
    inputs = inputs_for(desc, example("hiertrain", desc, links=links), batch=32)
    plan = plan_hiertrain(inputs)
    h = plan.predicted["hiertrain"]
    assert h["mapping"]["o"] == heavy  # the worker that trains the whole model
    share = flops_share(plan, desc)
    assert share[heavy] >= 0.75
    assert share.get("cloud" if heavy == "edge" else "edge", 0.0) <= 0.25


def flops_share(plan, desc) -> dict[str, float]:
    """The fraction of the step's forward FLOPs each device computes."""
    total = desc.flops * plan.microbatch_size()
    share: dict[str, float] = {}
    for s in plan.stages:
        flops = sum(layer.flops for layer in desc.layers[s.first:s.last])
        for d in s.devices:
            n = s.allocation[d] if s.mode == "dp" else plan.microbatch_size()
            share[d] = share.get(d, 0.0) + flops * n / total
    return share


# ---- Asteroid ---------------------------------------------------------------------------

def nanos(desc, mbps=1000):
    """Five Jetson Nanos (Asteroid's Table 2 setting); 50 GFLOP/s and 12 GB/s are assumptions."""
    return flops_cluster(desc, {f"nano{i}": (50, "2.5 GiB") for i in range(5)}, mbps=mbps, latency_ms=0.5,
                         mem_gbps=12)


@pytest.mark.parametrize("model,img", [("vgg16", 224), ("alexnet", 227), ("yolov2", 416)])
def test_asteroid_data_parallel_early_pipeline_late_for_cnns(model, img):
    desc = describe_model(model, img)
    plan = plan_asteroid(inputs_for(desc, nanos(desc), batch=32, micro=4))
    first, last = plan.stages[0], plan.stages[-1]
    assert first.mode == "dp" and len(first.devices) >= 2
    assert len(plan.stages) >= 2 and last.mode == "single"

    def maps_per_weight(s):  # feature-map bytes per weight byte: high early, low late
        return sum(layer.out_bytes for layer in desc.layers[s.first:s.last]) / \
            max(1, sum(layer.param_bytes for layer in desc.layers[s.first:s.last]))

    assert maps_per_weight(first) > 4 * maps_per_weight(last)


MLP = "[net]\nwidth=32\nheight=32\nchannels=3\n\n" + "[connected]\noutput=4096\nactivation=relu\n\n" * 8 + \
      "[connected]\noutput=10\nactivation=linear\n\n[softmax]\n"


@pytest.mark.parametrize("mbps", [100, 1000])
def test_asteroid_straight_pipeline_for_tiny_activations_and_large_weights(mbps):
    desc = describe_model("mlp", cfg_text=MLP)  # 130 M parameters, 16 KiB of activations per sample
    plan = plan_asteroid(inputs_for(desc, nanos(desc, mbps), batch=32, micro=4))
    assert len(plan.stages) >= 3
    assert all(s.mode == "single" for s in plan.stages)


def test_asteroid_memory_budget_is_hard(alexnet):
    """Squeezed memory: every device fits, and stage 0 needs a group to hold its activations."""
    desc = describe_model("yolov2-16", 416)
    cluster = flops_cluster(desc, {f"pi{i}": (4, "300 MiB") for i in range(6)}, mbps=100)
    inputs = inputs_for(desc, cluster, batch=8, micro=2)
    plan = plan_asteroid(inputs)
    assert plan.predicted["fits"]
    assert not plan_local(inputs).predicted["fits"]


# ---- Rama et al. -------------------------------------------------------------------------

def test_rama_compute_bound_pis_sync_at_every_layer():
    desc = describe_model("yolov2-16", 416)
    inputs = inputs_for(desc, example("rama-pi", desc), batch=1)
    plan = plan_tiles(inputs)
    stage = plan.stages[0]
    assert stage.mode == "tiles" and len(stage.devices) == 6
    syncs = stage.forward_syncs()
    assert len(syncs) >= 0.8 * (stage.last - stage.first)  # (nearly) every layer
    every = inputs.plan([Stage(0, 17, "tiles", stage.devices, grid=stage.grid, tile_devices=stage.tile_devices,
                               syncs=list(range(17)))], "tiles")
    fused = inputs.plan([Stage(0, 17, "tiles", stage.devices, grid=stage.grid, tile_devices=stage.tile_devices,
                               syncs=[0])], "tiles")
    assert inputs.simulate(every).step_time < inputs.simulate(fused).step_time


@pytest.mark.parametrize("memory,expect", [("4 GiB", 8), ("150 MiB", 2), ("100 MiB", 1)])
def test_a_whole_network_tiles_stage_runs_as_many_micro_batches_together_as_fit(memory, expect):
    """Same result, one exchange per sync for the block: the largest divisor of M that fits."""
    desc = describe_model("yolov2-16", 416)
    cluster = flops_cluster(desc, {f"pi{i}": (4, memory) for i in range(4)}, mbps=100)
    inputs = PlanInputs(desc, MemoryModel.for_devices(desc), cluster, 8, 8)
    plan = plan_tiles(inputs)
    stage = plan.stages[0]
    assert len(plan.stages) == 1 and plan.predicted["fits"]
    block = stage.block()
    assert block == expect
    for size in [size for size in (2, 4, 8) if size > block]:  # nothing larger fits
        larger = inputs.plan([Stage(0, 17, "tiles", stage.devices, grid=stage.grid, tile_devices=stage.tile_devices,
                                    syncs=stage.syncs, back_syncs=stage.back_syncs, together=size)], "tiles")
        assert not inputs.simulate(larger).fits


def test_rama_fast_gpus_prefer_larger_groups():
    """Two Jetson Nano GPUs on a 10 Gbit/s link (section 5.4): synchronisation, not compute, limits."""
    desc = describe_model("yolov2-16", 416)
    cluster = flops_cluster(desc, {"nano-1": (400, "2.5 GiB"), "nano-2": (400, "2.5 GiB")}, mbps=10_000,
                            latency_ms=2.0)
    inputs = inputs_for(desc, cluster, batch=1)
    plan = plan_tiles(inputs)
    stage = plan.stages[0]
    syncs = stage.forward_syncs()
    assert len(syncs) <= (stage.last - stage.first) // 2
    every = inputs.plan([Stage(0, 17, "tiles", stage.devices, grid=stage.grid, tile_devices=stage.tile_devices,
                               syncs=list(range(17)))], "tiles")
    assert plan.predicted["step_time_s"] < inputs.simulate(every).step_time
