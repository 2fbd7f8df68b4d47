"""The cluster description (JSON), cost tables, units, and the plans every planner returns."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner.cluster import ClusterError, bandwidth_matrix, cluster_from_dict
from planner.costs import CostTable
from planner.inputs import NoPlan, PlanInputs
from planner.memory import MemoryModel
from planner.planners import STRATEGIES, compare, make_plan
from planner.plan import Plan, PlanError
from planner.synthetic import flops_cluster
from planner.units import format_bytes, parse_bytes
from swarm.zoo import describe_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def desc():
    return describe_model("yolov2-16", 64)


def no_profiles(spec):
    raise AssertionError(f"unexpected profile {spec}")


def test_units():
    assert parse_bytes("1 GiB") == 2**30 and parse_bytes("512MB") == 512_000_000 and parse_bytes(100) == 100
    assert parse_bytes("1.5 g") == int(1.5 * 2**30)
    assert format_bytes(1.3 * 2**30) == "1.3 GiB" and format_bytes(900 * 2**20) == "900 MiB"
    for bad in ("lots", "-1 GiB", True, "1 parsec"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_cost_table_interpolates_and_extends():
    t = CostTable((1, 2, 4), [[1.0, 1.5, 2.5]], [[2.0, 3.0, 5.0]], [0.1], [0, 0, 0], [0, 0, 0])
    assert t.fwd_range(0, 1, 3) == pytest.approx(2.0)
    assert t.fwd_range(0, 1, 8) == pytest.approx(4.5)  # the last segment, extended
    assert t.scaled(2.0).fwd_range(0, 1, 3) == pytest.approx(1.0)
    noisy = CostTable((1, 2), [[1.0, 0.8]], [[1.0, 1.0]], [0.0], [0, 0], [0, 0])
    assert noisy.fwd_range(0, 1, 2) == pytest.approx(1.0)  # more samples never take less time
    assert noisy.fwd_range(0, 1, 8) == pytest.approx(4.0)  # too flat to extend: proportional
    assert CostTable.from_dict(t.to_dict()).fwd_range(0, 1, 3) == pytest.approx(2.0)


def test_flops_table_is_affine_with_memory_traffic(desc):
    t = CostTable.from_flops(desc, 10, mem_gbps=5)
    one, two, many = (t.range_time(0, 17, b) for b in (1, 2, 100))
    assert two - one == pytest.approx((many - one) / 99)  # constant cost per extra sample
    assert one - (two - one) > 0  # and a per-call part: the weights are read once per call


def test_every_example_cluster_loads(desc):
    for path in sorted(EXAMPLES.glob("*cluster*.json")):
        data = json.loads(path.read_text())
        if data.get("reference") == "local":
            cl = cluster_from_dict(data, desc, lambda spec: CostTable.from_flops(desc, 10))
        else:
            cl = cluster_from_dict(data, desc, no_profiles)
        assert len(cl.devices) >= 2, path.name
        assert all(d.memory > 0 for d in cl.devices)


@pytest.mark.parametrize("change,message", [
    ({"devices": []}, "lists no devices"),
    ({"devices": [{"name": "a", "memory": "1 GiB"}]}, "exactly one of"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "speed": 1}]}, "reference"),
    ({"devices": [{"name": "a", "gflops": 1}]}, "memory"),
    ({"devices": [{"name": "a", "memory": "lots", "gflops": 1}]}, "device a: memory"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1, "colour": "red"}]}, "unknown field"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1}, {"name": "a", "memory": "1 GiB", "gflops": 1}]},
     "used twice"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1}, {"name": "b", "memory": "1 GiB", "gflops": 1}]},
     "no bandwidth between a and b"),
    ({"bandwidth_mbps": 10, "data_source": "zz",
      "devices": [{"name": "a", "memory": "1 GiB", "gflops": 1}]}, "data_source 'zz'"),
    ({"bandwidth_mbps": 10, "links": [{"between": ["a", "q"], "mbps": 1}],
      "devices": [{"name": "a", "memory": "1 GiB", "gflops": 1}]}, "unknown device"),
    ({"wibble": 1, "devices": [{"name": "a", "memory": "1 GiB", "gflops": 1}]}, "unknown cluster field"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1, "comm_ns_per_byte": "fast"}]}, "comm_ns_per_byte"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1, "comm_ns_per_byte": -1}]}, "comm_ns_per_byte"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1, "msg_us": True}]}, "msg_us must be a number"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1, "msg_us": -5}]}, "msg_us must be a number"),
    ({"devices": [{"name": "a", "memory": "1 GiB", "gflops": 1, "reduce_msg_us": "x"}]}, "reduce_msg_us must be"),
])
def test_cluster_errors_say_what_is_wrong(desc, change, message):
    with pytest.raises(ClusterError, match=message):
        cluster_from_dict(change, desc, no_profiles)


def test_links_and_link_caps(desc):
    cl = cluster_from_dict({"bandwidth_mbps": 1000, "devices": [
        {"name": "a", "memory": "1 GiB", "gflops": 1, "link_mbps": 100},
        {"name": "b", "memory": "1 GiB", "gflops": 1},
        {"name": "c", "memory": "1 GiB", "gflops": 1}],
        "links": [{"from": "b", "to": "c", "mbps": 10}]}, desc, no_profiles)
    assert cl.bw("a", "b") == cl.bw("b", "a") == 100e6 / 8  # a's own link caps both directions
    assert cl.bw("b", "c") == 10e6 / 8 and cl.bw("c", "b") == 1000e6 / 8


def test_time_per_byte_moved_from_the_file(desc):
    cl = cluster_from_dict({"bandwidth_mbps": 80, "devices": [
        {"name": "a", "memory": "1 GiB", "gflops": 1, "comm_ns_per_byte": 200},
        {"name": "b", "memory": "1 GiB", "gflops": 1}]}, desc, no_profiles)
    assert cl.device("a").comm_s_per_byte == pytest.approx(200e-9) and cl.device("b").comm_s_per_byte == 0
    assert cl.transfer_time("b", "a", 1e6) == pytest.approx(0.2)  # 10 MB/s link, 5 MB/s through a


def test_time_per_message_from_the_file(desc):
    cl = cluster_from_dict({"bandwidth_mbps": 80, "latency_ms": 1, "devices": [
        {"name": "a", "memory": "1 GiB", "gflops": 1, "msg_us": 300},
        {"name": "b", "memory": "1 GiB", "gflops": 1, "msg_us": 200}]}, desc, no_profiles)
    assert cl.device("a").msg_s == pytest.approx(300e-6) and cl.msg_cpu(["a", "b"]) == pytest.approx(300e-6)
    assert cl.message_time("a", "b") == pytest.approx(1.5e-3)
    assert cl.transfer_time("a", "b", 1e6) == pytest.approx(1.5e-3 + 0.1)


def test_a_sums_own_work_per_message_from_the_file(desc):
    """reduce_msg_us is charged on a gradient sum's messages only, on top of msg_us."""
    from planner.stage_work import allreduce_messages, ring_allreduce_time

    spec = {"bandwidth_mbps": 80, "devices": [
        {"name": "a", "memory": "1 GiB", "gflops": 1, "msg_us": 300, "reduce_msg_us": 50},
        {"name": "b", "memory": "1 GiB", "gflops": 1, "msg_us": 200, "reduce_msg_us": 120}]}
    cl = cluster_from_dict(spec, desc, no_profiles)
    assert cl.device("a").reduce_msg_s == pytest.approx(50e-6)
    assert cl.reduce_msg_cpu(["a", "b"]) == pytest.approx(350e-6)  # the worst device's message and sum together
    assert cl.message_time("a", "b") == pytest.approx(0.5e-3)  # a plain message does not do a sum's work
    for d in spec["devices"]:
        d.pop("reduce_msg_us")
    bare = cluster_from_dict(spec, desc, no_profiles)
    extra = ring_allreduce_time(1e6, ["a", "b"], cl, buckets=3) - ring_allreduce_time(1e6, ["a", "b"], bare, buckets=3)
    assert extra == pytest.approx(3 * allreduce_messages(2) * 2 * 50e-6)


def test_measured_bandwidth_matrix_seam():
    bw = bandwidth_matrix(["a", "b", "c"], {("a", "b"): 10.0, ("b", "a"): 12.0, ("a", "c"): 5.0, ("b", "c"): 7.0})
    assert bw[0, 1] == 10 and bw[1, 0] == 12 and bw[2, 0] == 5 and bw[2, 1] == 7 and np.isinf(bw[0, 0])
    with pytest.raises(ClusterError, match="no bandwidth measured between a and c"):
        bandwidth_matrix(["a", "b", "c"], {("a", "b"): 10.0, ("b", "c"): 1.0})


@pytest.fixture(scope="module")
def small_inputs(desc):
    cl = flops_cluster(desc, {"a": (10, "1 GiB"), "b": (5, "1 GiB"), "c": (5, "512 MiB")}, mbps=100, latency_ms=0.5,
                       data_source="a")
    return PlanInputs(desc, MemoryModel.estimated(desc), cl, 8, 2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_planner_returns_a_valid_simulated_plan(small_inputs, strategy):
    plan = make_plan(strategy, small_inputs)
    plan.validate(small_inputs.desc)
    assert plan.predicted["step_time_s"] > 0 and set(plan.predicted["peak_memory"]) == set(plan.used_devices())
    again = Plan.from_json(plan.to_json())
    assert again.stages == plan.stages and again.predicted == json.loads(json.dumps(plan.predicted))
    assert small_inputs.simulate(again).step_time == pytest.approx(plan.predicted["step_time_s"])


def test_auto_is_at_least_as_good_as_every_planner(small_inputs):
    rows = {r.strategy: r for r in compare(small_inputs)}
    best = min(r.plan.predicted["step_time_s"] for name, r in rows.items() if r.plan and name != "auto"
               and r.plan.predicted["fits"])
    assert rows["auto"].plan.predicted["step_time_s"] <= best + 1e-12


def test_unknown_strategy(small_inputs):
    with pytest.raises(PlanError, match="unknown strategy 'fast'"):
        make_plan("fast", small_inputs)


def test_nothing_fits_says_how_much_is_missing(desc):
    cl = flops_cluster(desc, {"a": (10, "1 MiB"), "b": (10, "1 MiB")}, mbps=100)
    inputs = PlanInputs(desc, MemoryModel.estimated(desc), cl, 4, 1)
    with pytest.raises(PlanError, match="largest device, a, has 1 MiB"):
        make_plan("asteroid", inputs)
    plan = make_plan("local", inputs)
    over = inputs.simulate(plan).overflows(plan)
    assert over and "on device a, which has 1 MiB" in over[0].message()


def test_one_device_is_planned_whole_never_as_one_tile(desc):
    """A one-by-one grid on one device is the network run whole through the tiles executor:
    the same work, so a plan for one machine must not hinge on which of the two measured faster."""
    cl = flops_cluster(desc, {"a": (10, "1 GiB")}, mbps=100)
    inputs = PlanInputs(desc, MemoryModel.estimated(desc), cl, 8, 2)
    with pytest.raises(NoPlan, match="tiles need two devices or more"):
        make_plan("tiles", inputs)
    plan = make_plan("auto", inputs)
    assert [s.mode for s in plan.stages] == ["single"] and plan.used_devices() == ["a"]


def test_sums_on_lanes_are_priced_at_the_lanes_costs_from_the_file(desc):
    """Where every member of a group of up to DIRECT_REDUCE_MAX measured its lanes
    (lane_ns_per_byte, lane_us), its gradient sums are priced at them, without the event loop's
    per-byte, per-message and sum's own costs; a larger group, or one with a member whose lanes
    were not measured, sums through the event loop and is priced as before."""
    from planner.stage_work import DIRECT_REDUCE_MAX, allreduce_cpu, allreduce_messages, ring_allreduce_time

    def device(name, **lane):
        return {"name": name, "memory": "1 GiB", "gflops": 1, "comm_ns_per_byte": 30, "msg_us": 300,
                "reduce_msg_us": 50, **lane}

    names = [f"d{i}" for i in range(DIRECT_REDUCE_MAX + 1)]
    lanes = cluster_from_dict({"bandwidth_mbps": 1000, "devices": [device(n, lane_ns_per_byte=4, lane_us=150)
                                                                   for n in names]}, desc, no_profiles)
    assert lanes.device("d0").lane_s_per_byte == pytest.approx(4e-9) and lanes.device("d0").lane_msg_s == pytest.approx(150e-6)
    nbytes, buckets = 8e6, 3
    for g in (2, DIRECT_REDUCE_MAX):
        group = names[:g]
        moved = 2 * 2 * (g - 1) / g * nbytes
        messages = buckets * allreduce_messages(g) * 2
        assert allreduce_cpu(nbytes, group, lanes, buckets) == pytest.approx(
            {d: moved * 4e-9 + messages * 150e-6 for d in group})
        link = 2 * (g - 1) / g * nbytes * max(8 / 1e9, 2 * 4e-9)
        assert ring_allreduce_time(nbytes, group, lanes, buckets) == pytest.approx(link + messages * 150e-6)
    loop = cluster_from_dict({"bandwidth_mbps": 1000, "devices": [device(n) for n in names]}, desc, no_profiles)
    assert allreduce_cpu(nbytes, names[:2], lanes, buckets)["d0"] < allreduce_cpu(nbytes, names[:2], loop, buckets)["d0"]
    # DIRECT_REDUCE_MAX + 1 members sum through the event loop
    assert allreduce_cpu(nbytes, names, lanes, buckets) == pytest.approx(allreduce_cpu(nbytes, names, loop, buckets))
    one_unmeasured = cluster_from_dict({"bandwidth_mbps": 1000, "devices": [
        device("d0", lane_ns_per_byte=4, lane_us=150), device("d1")]}, desc, no_profiles)
    assert ring_allreduce_time(nbytes, ["d0", "d1"], one_unmeasured, buckets) == pytest.approx(
        ring_allreduce_time(nbytes, ["d0", "d1"], loop, buckets))
    with pytest.raises(ClusterError, match="lane_us"):
        cluster_from_dict({"devices": [device("d0", lane_us=-1)]}, desc, no_profiles)


def test_a_sum_whose_chunks_follow_each_members_samples_is_priced_at_what_each_member_moves(desc):
    """The one-pair plan of the mixed swarm (dev5 three micro-batches of 4, dev4 two, dev2 and dev3
    one, dev0 and dev1 splitting one): each device owns a chunk of every sum in proportion to its
    samples a step (Stage.sum_weights) and is charged the 2(S - c) + 2(g - 1)c bytes that makes it,
    so the 0.1-core pair moves 2.5 S rather than the 3.3 S of equal chunks; the sum's time is set
    by the member that moves the most."""
    from planner.plan import Stage
    from planner.stage_work import allreduce_cpu, allreduce_messages, ring_allreduce_time

    stage = Stage(0, len(desc.layers), "dp", ["dev5", "dev4", "dev3", "dev2", "dev0", "dev1"],
                  allocation={"dev5": 4, "dev4": 4, "dev3": 4, "dev2": 4, "dev0": 2, "dev1": 2},
                  replicas=5, shares=[3, 2, 1, 1, 1], groups=[1, 1, 1, 1, 2])
    weights = stage.sum_weights(8)
    assert weights == {"dev5": 12, "dev4": 8, "dev3": 4, "dev2": 4, "dev0": 2, "dev1": 2}
    assert Stage(0, 3, "dp", ["a", "b"], allocation={"a": 2, "b": 2}).sum_weights(8) is None  # equal: equal chunks
    assert Stage(0, 3, "single", ["a", "b"], replicas=2, shares=[5, 3]).sum_weights(8) == {"a": 5, "b": 3}

    names = list(weights)
    cl = cluster_from_dict({"bandwidth_mbps": 1000, "devices": [
        {"name": n, "memory": "1 GiB", "gflops": 1, "lane_ns_per_byte": 4, "lane_us": 150} for n in names]},
        desc, no_profiles)
    nbytes, g = 6e6, len(names)
    messages = allreduce_messages(g) * 2 * 150e-6
    weighed = allreduce_cpu(nbytes, names, cl, 1, weights)
    for d in names:
        assert weighed[d] == pytest.approx((2 * nbytes + 2 * (g - 2) * nbytes * weights[d] / 32) * 4e-9 + messages)
    assert weighed["dev0"] == pytest.approx(2.5 * nbytes * 4e-9 + messages)
    equal = allreduce_cpu(nbytes, names, cl, 1)
    assert weighed["dev0"] < equal["dev0"] < weighed["dev5"]
    assert ring_allreduce_time(nbytes, names, cl, 1, weights) == pytest.approx(
        messages + 5 * nbytes / 2 * max(8 / 1e9, 2 * 4e-9))  # dev5 moves 5 S
    # the pair's lanes cost six times dev5's a byte (a sixth of the CPU): the pair sets the pace
    slow = cluster_from_dict({"bandwidth_mbps": 1000, "devices": [
        {"name": n, "memory": "1 GiB", "gflops": 1, "lane_ns_per_byte": 24 if n in ("dev0", "dev1") else 4,
         "lane_us": 150} for n in names]}, desc, no_profiles)
    assert ring_allreduce_time(nbytes, names, slow, 1, weights) == pytest.approx(
        messages + 2.5 * nbytes / 2 * 2 * 24e-9)
    assert ring_allreduce_time(nbytes, names, slow, 1) == pytest.approx(
        messages + 2 * (g - 1) / g * nbytes * 2 * 24e-9)
