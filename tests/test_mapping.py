"""Plans whose devices map their largest blocks afresh (Plan.mapped, planner.mapping): the
memory model of a mapped heap, the time each layer's fresh blocks add, `auto` mapping where
memory held its plan back and not where it did not, the plan's field in JSON and validation,
and a device's profile measuring what mapping costs it. The runtime's side is in
tests/test_malloc.py; the weights a mapped plan trains are in tests/test_swarm_training.py."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.cluster import ClusterError, cluster_from_dict
from planner.inputs import PlanInputs
from planner.mapping import MAPPED_FROM, MAPPED_SLACK, can_map, fresh_bytes, mapped_model, mapping
from planner.memory import MemoryModel
from planner.memory_fit import memory_overflows
from planner.plan import Plan, PlanError, Stage
from planner.planners import _plan_auto, plan_auto
from planner.report import plan_table
from planner.simulator import simulate
from planner.synthetic import flops_cluster
from swarm.host import malloc
from swarm.profiling.mapping import map_cost
from swarm.profiling.survey import map_time
from swarm.zoo import describe_model

MiB = 2**20
MAP_S_PER_BYTE = 0.2e-9  # about what a real 4-sample pass pays here; a profile measures 0.1e-9 (bench/RESULTS.md)


@pytest.fixture(scope="module")
def yolov2():
    return describe_model("yolov2-16", 416)


def _mapping(cluster, s_per_byte=MAP_S_PER_BYTE):
    return replace(cluster, devices=[replace(d, map_s_per_byte=s_per_byte) for d in cluster.devices])


def test_a_mapped_heap_holds_the_papers_model_with_the_buffers_in_freed_room(yolov2):
    mem = MemoryModel.for_devices(yolov2, "sgd")  # glibc's heap: slack 1.15, no reuse
    mapped = mapped_model(mem)
    n = len(yolov2.layers)
    assert (mapped.slack, mapped.reuse, mapped.growth) == (MAPPED_SLACK, True, 0.0)
    assert mapped.whole_reserve == mem.whole_reserve and mapped.kept == mem.kept
    for b in (1, 2, 4):  # less than the heap's, by more than the slack alone
        assert mapped.stage(0, n, b, 1) < mem.stage(0, n, b, 1) - (mem.slack - 1) * mem.activations(0, n, b) / mem.slack


def test_the_fresh_blocks_of_a_layer_are_its_maps_of_mapped_size(yolov2):
    fwd, bwd = fresh_bytes(yolov2, (1, 4, 16))
    est = MemoryModel.estimated(yolov2)
    first = yolov2.layers[0]
    assert first.batch_normalize and first.activation != "linear"
    # the first conv's output, BatchNorm's and the activation's: 11 MiB a sample at 416, mapped at any size
    assert est.out_bytes[0] >= MAPPED_FROM
    assert fwd[0, 0] == pytest.approx(3 * est.out_bytes[0]) and fwd[0, 2] == pytest.approx(16 * fwd[0, 0])
    assert bwd[0, 1] >= fwd[0, 1]  # and the gradients of each
    # a layer whose maps are smaller than MAPPED_FROM for one sample has none mapped at one
    small = [i for i in range(len(yolov2.layers)) if 0 < est.out_bytes[i] < MAPPED_FROM / 4]
    assert small and all(fwd[i, 0] == 0 for i in small) and any(fwd[i, 2] > 0 for i in small)


def test_mapping_adds_each_devices_fresh_bytes_at_its_own_rate(yolov2):
    mem = MemoryModel.for_devices(yolov2, "sgd")
    cluster = flops_cluster(yolov2, {"d0": (50, "4 GiB"), "d1": (20, "4 GiB")})
    with pytest.raises(ValueError, match="cannot map"):
        mapping(mem, cluster, yolov2)
    assert not can_map(cluster)
    cluster = replace(cluster, devices=[replace(cluster.devices[0], map_s_per_byte=1e-10),
                                        replace(cluster.devices[1], map_s_per_byte=3e-10)])
    m2, c2 = mapping(mem, cluster, yolov2)
    assert c2.mapping and not cluster.mapping and m2.reuse and m2.slack == MAPPED_SLACK
    for d, rate in (("d0", 1e-10), ("d1", 3e-10)):
        before, after = cluster.device(d).costs, c2.device(d).costs
        fwd, bwd = fresh_bytes(yolov2, before.batch_sizes)
        assert np.allclose(after.fwd - before.fwd, fwd * rate) and np.allclose(after.bwd - before.bwd, bwd * rate)
    m3, c3 = mapping(m2, c2, yolov2)  # idempotent
    assert c3 is c2 and m3.slack == m2.slack
    assert c2.subset(["d1"]).mapping and c2.on_cpus().mapping
    # a plan simulated mapped: more time, less memory
    n = len(yolov2.layers)
    plain = Plan("yolov2-16", 416, 8, 2, [Stage(0, n, "dp", ["d0", "d1"], allocation={"d0": 4, "d1": 4},
                                                replicas=2, groups=[1, 1])])
    mapped = replace(plain, mapped=True)
    a, b = simulate(plain, yolov2, mem, cluster), simulate(mapped, yolov2, mem, cluster)
    assert b.step_time > a.step_time
    assert all(b.peak_memory[d] < a.peak_memory[d] for d in ("d0", "d1"))


def _tight(yolov2):
    """Six devices of 20-60 GFLOP/s, yolov2-16 at 416, batch 32 in 8 micro-batches of 4, each
    with a budget that holds a whole micro-batch mapped but neither in the heap, where it takes 2
    samples and shares each micro-batch with a partner, nor remaking BatchNorm (whose largest
    layers back-propagate a few channels at a time: 308 MiB for the 4 samples, mapped 298):
    halfway between the two."""
    mem = MemoryModel.for_devices(yolov2, "sgd")
    n = len(yolov2.layers)

    def need(m, samples):
        return m.stage(0, n, samples, 1) - m.budget(0, n, 0.0)

    budget = (need(mapped_model(mem), 4) + need(mem.recomputing(), 4)) / 2
    assert budget < need(mem, 4) and mem.max_batch(0, n, 1, budget) < 4
    assert need(mapped_model(mem), 4) < budget < need(mem.recomputing(), 4)
    speeds = (20, 20, 30, 30, 50, 60)
    return mem, {f"d{i}": (g, f"{int(budget)}") for i, g in enumerate(speeds)}


def test_auto_maps_where_memory_held_its_plan_back_and_not_where_it_did_not(yolov2):
    mem, devices = _tight(yolov2)
    # 10 ms a message: pairs pay their BatchNorm exchanges where whole mapped micro-batches do not (at 5 ms,
    # since the simulator overlaps the sums with the last backward, the pairs' 7.64 s beat mapping's 7.70)
    cluster = _mapping(flops_cluster(yolov2, devices, latency_ms=10))
    inputs = PlanInputs(yolov2, mem, cluster, 32, 8)
    keeping, plan = _plan_auto(inputs), plan_auto(inputs)
    assert any(max(s.group_sizes()) > 1 for s in keeping.stages if s.mode == "dp")  # held back: groups
    assert plan.mapped and not plan.recomputes() and not plan.checkpoints()
    assert all(max(s.group_sizes()) == 1 for s in plan.stages if s.mode == "dp")  # whole micro-batches
    again = simulate(plan, yolov2, mem, cluster)
    assert again.fits and again.step_time == pytest.approx(plan.predicted["step_time_s"])
    assert again.step_time < keeping.predicted["step_time_s"]
    assert not simulate(replace(plan, mapped=False), yolov2, mem, cluster).fits  # in the heap it would not fit
    assert "maps its largest blocks afresh" in plan_table(plan, again)
    assert "largest blocks mapped afresh" in plan.describe().splitlines()[0]
    # devices that cannot map (no cost measured) are never planned mapped
    assert not plan_auto(PlanInputs(yolov2, mem, flops_cluster(yolov2, devices, latency_ms=5), 32, 8)).mapped
    # with room for the heap, mapping is only more time: not chosen
    roomy = {d: (g, "4 GiB") for d, (g, _) in devices.items()}
    assert not plan_auto(PlanInputs(yolov2, mem, _mapping(flops_cluster(yolov2, roomy, latency_ms=5)), 32, 8)).mapped


def test_a_plan_says_it_maps_and_a_mapped_plan_is_checked(yolov2):
    n = len(yolov2.layers)
    plan = Plan("yolov2-16", 416, 8, 2, [Stage(0, n, "dp", ["d0", "d1"], allocation={"d0": 4, "d1": 4},
                                               replicas=2, groups=[1, 1])], mapped=True)
    again = Plan.from_json(plan.to_json())
    assert again.mapped and again.to_dict()["mapped"] is True
    assert "mapped" not in replace(plan, mapped=False).to_dict()  # plans that do not map read as before
    with pytest.raises(PlanError, match="mapped is true or false"):
        Plan.from_dict(dict(plan.to_dict(), mapped="yes"))
    remade = Plan.from_dict(plan.to_dict())
    remade.stages[0].recompute = True
    with pytest.raises(PlanError, match="keeps every map"):
        remade.validate(yolov2)
    # on devices that cannot map: one line, naming them
    cluster = flops_cluster(yolov2, {"d0": (50, "4 GiB"), "d1": (50, "4 GiB")})
    with pytest.raises(PlanError, match="d0, d1 cannot map"):
        simulate(plan, yolov2, MemoryModel.for_devices(yolov2), cluster)
    # and what a plan file is checked against before it runs does not need it
    assert memory_overflows(plan, yolov2, {"d0": 4 * 2**30, "d1": 4 * 2**30}) == []


def test_a_cluster_file_gives_a_devices_mapping_cost(yolov2):
    spec = {"name": "c", "bandwidth_mbps": 100, "devices": [{"name": "d0", "memory": "500 MiB", "gflops": 10, "map_ns_per_byte": 0.25},
                                     {"name": "d1", "memory": "500 MiB", "gflops": 10}]}
    cluster = cluster_from_dict(spec, yolov2, None)
    assert cluster.device("d0").map_s_per_byte == pytest.approx(0.25e-9) and cluster.device("d1").map_s_per_byte == 0
    assert not can_map(cluster)
    with pytest.raises(ClusterError, match="map_ns_per_byte"):
        cluster_from_dict(dict(spec, devices=[dict(spec["devices"][0], map_ns_per_byte=-1)]), yolov2, None)


def test_a_profiles_mapping_cost_is_spread_over_the_devices_quota():
    assert map_time({"map_cpu_s_per_byte": 2e-10}) == pytest.approx(2e-10)
    assert map_time({"map_cpu_s_per_byte": 2e-10, "cpu_quota": 0.25}) == pytest.approx(8e-10)
    assert map_time({"allocator": "glibc"}) == 0.0


def test_the_planner_maps_what_the_runtime_maps():
    assert MAPPED_FROM == malloc.MAPPED_FROM  # (planner/ does not import swarm/: two constants, one value)


def test_a_process_that_cannot_map_measures_nothing():
    """This test process was not started by `swarm` with its glibc tunables."""
    assert not malloc.can_map() and map_cost() == 0.0 and malloc.map_large(True) is False


MAP_COST_PROBE = """
import torch
from swarm.host import malloc
malloc.tune()
from swarm.profiling.mapping import map_cost
from swarm.zoo import build_model
net, desc, _ = build_model("yolov2-16", 416, classes=5, seed=1)
for b in (1, 2):  # a profile's work before it: the heap grown, its free chunks as large as maps
    net(torch.rand(b, *desc.layers[0].in_shape)).sum().backward()
print(malloc.allocator(), *(map_cost() for _ in range(3)))
"""


def test_a_profile_measures_mapping_after_work_that_grew_its_heap():
    """A heap that holds a free chunk as large as a block serves it from there even where the
    process maps its largest blocks (glibc maps only what its heap cannot hold): measured
    through malloc, such a pass mapped nothing, and three profiles in a row read 0, 5e-12 and
    0 s a byte. map_cost maps its blocks itself, so a profile reads what mapping costs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "SWARM_MALLOC")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parent.parent), GLIBC_TUNABLES=malloc.GLIBC_TUNABLES,
               **{malloc.PRELOADED: "glibc"})
    out = subprocess.run([sys.executable, "-c", MAP_COST_PROBE], capture_output=True, text=True, env=env, check=True)
    name, *costs = out.stdout.split()
    assert name == "glibc"
    assert all(2e-11 < float(c) < 5e-9 for c in costs), costs  # this machine: 0.3-1.1e-10
