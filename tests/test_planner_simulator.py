"""The simulator against hand-computed timelines: local steps, 1F1B pipelines, transfers,
data-parallel groups, the data source, memory (Asteroid eq. 3) and the schedule order."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from planner.cluster import Cluster, Device
from planner.costs import CostTable
from planner.memory import MemoryModel
from planner.plan import Plan, PlanError, Stage
from planner.schedule import asteroid_warmup, stage_schedule
from planner.simulator import simulate
from planner.buckets import buckets_of
from swarm.zoo import describe_model

FAST = 1e15  # bytes/s: transfers that take no time


def uniform_table(n_layers: int, fwd: float, bwd: float, update: float = 0.0) -> CostTable:
    """Every layer takes `fwd`/`bwd` seconds per sample (linear in the batch), no loss cost."""
    return CostTable((1,), np.full(n_layers, fwd), np.full(n_layers, bwd), np.full(n_layers, update), [0.0], [0.0])


def cluster_of(tables: dict[str, CostTable], bw: float = FAST, latency: float = 0.0, memory: float = 2**40,
               data_source: str | None = None) -> Cluster:
    devs = [Device(n, t, memory) for n, t in tables.items()]
    n = len(devs)
    return Cluster(devs, np.full((n, n), bw), latency, data_source)


@pytest.fixture(scope="module")
def lenet():
    desc = describe_model("lenet5")
    return desc, MemoryModel.estimated(desc)


def plan_of(stages, batch=4, micro=4, devices=("a", "b", "c")):
    return Plan("lenet5", 32, batch, micro, stages, devices={d: {} for d in devices})


def test_local_step_is_the_sum_of_its_parts(lenet):
    desc, mem = lenet
    cl = cluster_of({"a": uniform_table(7, 0.01, 0.02, update=0.001)})
    t = simulate(plan_of([Stage(0, 7, "single", ["a"])], batch=8, micro=2, devices=("a",)), desc, mem, cl)
    # two micro-batches of 4: 7 layers x 4 samples x (0.01 + 0.02), then one update of 7 layers
    assert t.step_time == pytest.approx(2 * 7 * 4 * 0.03 + 7 * 0.001)
    assert t.throughput == pytest.approx(8 / t.step_time)
    kinds = [(e.kind, e.micro) for e in t.events]
    assert kinds == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("update", None)]


@pytest.mark.parametrize("micro", [1, 2, 4, 6])
def test_balanced_pipeline_takes_m_plus_p_minus_one_rounds(lenet, micro):
    """P equal stages, free transfers: 1F1B finishes after (M + P - 1) forward+backward rounds."""
    desc, mem = lenet
    table = uniform_table(7, 0.01, 0.02)
    table.fwd[6] = table.bwd[6] = 0.0  # so that layers 4-6 take as long as 0-1 and 2-3
    cl = cluster_of({"a": table, "b": table, "c": table})
    stages = [Stage(0, 2, "single", ["a"]), Stage(2, 4, "single", ["b"]), Stage(4, 7, "single", ["c"])]
    t = simulate(plan_of(stages, batch=micro, micro=micro), desc, mem, cl)
    round_time = 2 * 0.03  # two layers per stage, one sample per micro-batch
    assert t.step_time == pytest.approx((micro + 3 - 1) * round_time)


def test_each_stage_follows_stage_schedule(lenet):
    desc, mem = lenet
    cl = cluster_of({n: uniform_table(7, 0.01 * (k + 1), 0.02) for k, n in enumerate("abc")})
    stages = [Stage(0, 2, "single", ["a"]), Stage(2, 4, "single", ["b"]), Stage(4, 7, "single", ["c"])]
    t = simulate(plan_of(stages, batch=6, micro=6), desc, mem, cl)
    for p, dev in enumerate("abc"):
        order = [(e.kind, e.micro) for e in t.events if e.device == dev and e.kind in "FB"]
        assert order == stage_schedule(6, asteroid_warmup(3, p))


def test_transfers_cost_latency_plus_bytes_over_bandwidth(lenet):
    desc, mem = lenet
    bw, lat = 1e6, 0.002
    table = uniform_table(7, 0.01, 0.02)
    cl = cluster_of({"a": table, "b": table}, bw=bw, latency=lat)
    t = simulate(plan_of([Stage(0, 3, "single", ["a"]), Stage(3, 7, "single", ["b"])], batch=1, micro=1,
                         devices=("a", "b")), desc, mem, cl)
    x = lat + mem.boundary(3) / bw  # activation forward, the same bytes of gradient backward
    expected = 3 * 0.01 + x + 4 * 0.03 + x + 3 * 0.02 + 2 * lat  # + the commit round trip
    assert t.step_time == pytest.approx(expected)
    sends = [e for e in t.events if e.kind == "send"]
    assert [(e.device, e.peer) for e in sends] == [("a", "b"), ("b", "a")]
    assert all(e.nbytes == mem.boundary(3) for e in sends)


def test_data_source_sends_uint8_images(lenet):
    desc, mem = lenet
    table = uniform_table(7, 0.01, 0.02)
    cl = cluster_of({"a": table, "src": table}, bw=1e6, data_source="src")
    t = simulate(plan_of([Stage(0, 7, "single", ["a"])], batch=2, micro=1, devices=("a", "src")), desc, mem, cl)
    inputs = [e for e in t.events if e.kind == "input"]
    assert len(inputs) == 1 and inputs[0].nbytes == 2 * 32 * 32  # one channel of 32x32 bytes per sample
    assert t.step_time == pytest.approx(2 * 32 * 32 / 1e6 + 2 * 7 * 0.03)


def test_dp_group_splits_samples_and_all_reduces(lenet):
    desc, mem = lenet
    bw, lat = 1e7, 0.001
    cl = cluster_of({"a": uniform_table(7, 0.01, 0.02), "b": uniform_table(7, 0.02, 0.04)}, bw=bw, latency=lat)
    plan = plan_of([Stage(0, 7, "dp", ["a", "b"], allocation={"a": 4, "b": 2})], batch=6, micro=1, devices=("a", "b"))
    t = simulate(plan, desc, mem, cl)
    compute = 7 * 4 * 0.03  # both take 0.84 s: a on 4 samples, b (half as fast) on 2
    allreduce = 2 * lat + 2 * (2 - 1) / 2 * float(mem.param_bytes.sum()) / bw
    assert t.settled_s == pytest.approx(compute + allreduce + 2 * lat)
    # lenet's weights are one bucket, which holds layer 0: the next forward starts once its
    # sum is in (the commit's round trip runs beside the sum)
    assert t.step_time == pytest.approx(compute + allreduce)
    assert t.summary()["settled_step_s"] == pytest.approx(t.settled_s)
    assert [e.kind for e in t.events if e.kind == "allreduce"] == ["allreduce", "allreduce"]


def test_the_next_forward_waits_at_its_first_layer_for_the_bucket_holding_it(lenet):
    """Each bucket's update is applied once its sum and the commit are in, and the next
    forward waits layer by layer for it: lenet's one bucket holds its first layer, so the
    next step starts once that bucket's sum and update are in; a tiles stage, whose layers
    run past those gates, settles every step."""
    desc, mem = lenet
    bw, lat, update = 1e5, 0.001, 0.05
    cl = cluster_of({d: uniform_table(7, 0.01, 0.02, update / 7) for d in "ab"}, bw=bw, latency=lat)
    plan = plan_of([Stage(0, 7, "dp", ["a", "b"], allocation={"a": 1, "b": 1})], batch=4, micro=2, devices=("a", "b"))
    t = simulate(plan, desc, mem, cl)
    first_forward, compute = 7 * 0.01, 2 * 7 * 0.03  # each device: 1 sample of each micro-batch
    allreduce = 2 * lat + float(mem.param_bytes.sum()) / bw  # 2 (g - 1) / g of the bytes, g = 2
    assert allreduce > first_forward
    assert t.settled_s == pytest.approx(compute + allreduce + 2 * lat + update)
    assert t.step_time == pytest.approx(compute + allreduce + update)
    tiles = plan_of([Stage(0, 2, "tiles", ["a", "b"], grid=[1, 2], tile_devices=["a", "b"], syncs=[0, 1]),
                     Stage(2, 7, "dp", ["a", "b"], allocation={"a": 1, "b": 1})], batch=4, micro=2, devices=("a", "b"))
    t = simulate(tiles, desc, mem, cl)
    assert t.step_time == t.settled_s


def test_the_upper_buckets_sums_run_during_the_last_backward():
    """A bucket's sum starts once the last backward has passed its lowest layer and the
    buckets above it have gone (the workers' GradReducer), each taking the sum's time by its
    bytes: of yolov2-16's gradients, summed slower than the backward runs, only what the
    backward had not finished waits for its end."""
    desc = describe_model("yolov2-16", 416)
    mem, n = MemoryModel.estimated(desc), len(desc.layers)
    bw, fwd, bwd, update = 1e7, 0.01, 0.02, 0.05
    cl = cluster_of({d: uniform_table(n, fwd, bwd, update / n) for d in "ab"}, bw=bw)
    plan = Plan("yolov2-16", 416, 2, 1, [Stage(0, n, "dp", ["a", "b"], allocation={"a": 1, "b": 1})],
                devices={"a": {}, "b": {}})
    t = simulate(plan, desc, mem, cl)
    sizes = {i: int(b) for i, b in enumerate(mem.param_bytes) if b > 0}
    buckets = buckets_of(sizes)
    assert len(buckets) > 2
    (forward,) = [e for e in t.events if e.kind == "F" and e.device == "a"]
    (backward,) = [e for e in t.events if e.kind == "B" and e.device == "a"]
    start, end = backward.start, backward.end  # n layers of 0.02 s (and the loss)
    assert start == pytest.approx(forward.end) and end - start == pytest.approx(n * bwd, rel=0.1)
    done = start
    for bucket in buckets:  # uniform layers: the backward has passed layer k after (n - k) of its n layers
        done = max(done, start + (end - start) * (n - min(bucket)) / n) + sum(sizes[i] for i in bucket) / bw
    allreduce = sum(sizes.values()) / bw  # 2 (g - 1) / g of the bytes, g = 2, no latency
    assert done < end + allreduce
    assert done > end + sizes[min(sizes)] / bw  # the lowest bucket's sum follows the backward
    # each bucket's sum and update (by its bytes) in before the next forward reaches its lowest layer
    held, summed, gate = sum(sizes.values()), start, 0.0
    for bucket in buckets:
        nbytes = sum(sizes[i] for i in bucket)
        summed = max(summed, start + (end - start) * (n - min(bucket)) / n) + nbytes / bw
        reach = forward.start + (forward.end - forward.start) * min(bucket) / n
        gate = max(gate, max(summed, end) + update * nbytes / held - reach)
    assert summed == pytest.approx(done)
    assert t.step_time == pytest.approx(gate)
    assert t.settled_s == pytest.approx(end + allreduce + update)  # a settled step sums after its backward


def test_memory_is_asteroid_eq3(lenet):
    desc, mem = lenet
    table = uniform_table(7, 0.01, 0.02)
    cl = cluster_of({"a": table, "b": table})
    stages = [Stage(0, 3, "single", ["a"]), Stage(3, 7, "single", ["b"])]
    t = simulate(plan_of(stages, batch=8, micro=4, devices=("a", "b")), desc, mem, cl)
    # stage 0 warms up with K = 3 micro-batches of 2 samples; stage 1 with 1
    assert t.peak_memory["a"] == pytest.approx(mem.stage(0, 3, 2, 3))
    assert t.peak_memory["b"] == pytest.approx(mem.stage(3, 7, 2, 1))
    assert t.eq3_memory == pytest.approx(t.peak_memory)


def test_overflow_names_device_and_shortfall(lenet):
    desc, mem = lenet
    cl = cluster_of({"a": uniform_table(7, 0.01, 0.02)}, memory=100_000)
    plan = plan_of([Stage(0, 7, "single", ["a"])], batch=8, micro=1, devices=("a",))
    t = simulate(plan, desc, mem, cl)
    assert not t.fits
    (over,) = t.overflows(plan)
    assert over.device == "a" and over.need == pytest.approx(mem.stage(0, 7, 8, 1))
    assert "stage 0 needs" in over.message() and "device a, which has 97.7 KiB" in over.message()


def test_device_serving_two_stages_finishes(lenet):
    """A HierTrain-like plan: device a runs stages 0 and 2, b helps with stage 0."""
    desc, mem = lenet
    table = uniform_table(7, 0.01, 0.02)
    cl = cluster_of({"a": table, "b": table}, bw=1e8)
    stages = [Stage(0, 2, "dp", ["a", "b"], allocation={"a": 1, "b": 1}), Stage(2, 4, "single", ["b"]),
              Stage(4, 7, "single", ["a"])]
    t = simulate(plan_of(stages, batch=8, micro=4, devices=("a", "b")), desc, mem, cl)
    for p, s in enumerate(stages):
        for d in s.devices:
            order = [(e.kind, e.micro) for e in t.events if e.device == d and e.stage == p and e.kind in "FB"]
            assert order == stage_schedule(4, asteroid_warmup(3, p))
    assert t.step_time > 0 and t.fits


def test_unknown_device_is_refused(lenet):
    desc, mem = lenet
    cl = cluster_of({"a": uniform_table(7, 0.01, 0.02)})
    with pytest.raises(Exception, match="no device 'zz'"):
        simulate(plan_of([Stage(0, 7, "single", ["zz"])], devices=("zz",)), desc, mem, cl)
    with pytest.raises(PlanError):
        simulate(plan_of([Stage(0, 6, "single", ["a"])], devices=("a",)), desc, mem, cl)


def test_a_link_runs_no_faster_than_its_ends_move_bytes(lenet):
    """A device that spends more time per byte than the link takes (a CPU-starved end) sets
    the pace of its transfers; a ring moves every byte in and out of each device at once."""
    from planner.stage_work import ring_allreduce_time

    desc, mem = lenet
    bw, lat = 1e6, 0.002
    table = uniform_table(7, 0.01, 0.02)
    plan = plan_of([Stage(0, 3, "single", ["a"]), Stage(3, 7, "single", ["b"])], batch=1, micro=1, devices=("a", "b"))
    cl = cluster_of({"a": table, "b": table}, bw=bw, latency=lat)
    fast = simulate(plan, desc, mem, cl).step_time
    cl.device("b").comm_s_per_byte = 0.5 / bw  # half the link's time: the link still sets the pace
    assert simulate(plan, desc, mem, cl).step_time == pytest.approx(fast)
    cl.device("b").comm_s_per_byte = 3 / bw  # three times slower than the link
    x_slow, x_fast = lat + 3 * mem.boundary(3) / bw, lat + mem.boundary(3) / bw
    assert simulate(plan, desc, mem, cl).step_time == pytest.approx(fast + 2 * (x_slow - x_fast))

    group, nbytes = ["a", "b"], 1e6
    cl.device("b").comm_s_per_byte = 0.4 / bw
    assert ring_allreduce_time(nbytes, group, cl) == pytest.approx(2 * lat + nbytes / bw)
    cl.device("b").comm_s_per_byte = 2 / bw
    assert ring_allreduce_time(nbytes, group, cl) == pytest.approx(2 * lat + nbytes * 4 / bw)


def test_every_message_costs_its_ends_their_time_per_message(lenet):
    """A device's time per message (what a message costs a CPU-rationed device beyond the
    latency) adds to every transfer once per end, to each step of a ring once per message in
    and out, and to an all-gather once per message to and from each other member."""
    from planner.stage_work import allgather_time, ring_allreduce_time

    desc, mem = lenet
    bw, lat, m = 1e6, 0.002, 0.003
    table = uniform_table(7, 0.01, 0.02)
    plan = plan_of([Stage(0, 3, "single", ["a"]), Stage(3, 7, "single", ["b"])], batch=1, micro=1, devices=("a", "b"))
    cl = cluster_of({"a": table, "b": table, "c": table}, bw=bw, latency=lat)
    free = simulate(plan, desc, mem, cl).step_time
    ring, gather = ring_allreduce_time(1e6, ["a", "b", "c"], cl, 4), allgather_time(1e3, ["a", "b", "c"], cl)
    cl.device("b").msg_s = m
    # one activation forward and its gradient back, each handled once at b
    assert simulate(plan, desc, mem, cl).step_time == pytest.approx(free + 2 * m)
    # 4 rings of 2(g-1) = 4 steps, a message out and one in at each, paced by the slowest member
    assert ring_allreduce_time(1e6, ["a", "b", "c"], cl, 4) == pytest.approx(ring + 4 * 4 * 2 * m)
    assert allgather_time(1e3, ["a", "b", "c"], cl) == pytest.approx(gather + 2 * 2 * m)


def test_a_batchnorm_exchange_inside_a_pipeline_costs_more_than_its_messages():
    """A gang's BatchNorm exchange is an all-gather of its members' sums: each costs its
    messages, and inside a pipeline EXCHANGE_MESSAGES messages' time more (as measured), in the
    step and in the members' own CPU, once per BatchNorm layer."""
    from planner.stage_work import EXCHANGE_MESSAGES, allgather_cpu, allgather_time, bn_sync_cpu, bn_sync_time
    from planner.synthetic import flops_cluster

    desc = describe_model("yolov2-16", 64, classes=5)
    cl = flops_cluster(desc, {d: (4, "1 GiB") for d in "ab"}, mbps=100)
    for d in "ab":
        cl.device(d).msg_s = 0.002
    bns = [layer for layer in desc.layers[0:6] if layer.batch_normalize]
    assert len(bns) == 4
    gathers = sum(allgather_time(8 + 16 * layer.out_shape[0], ["a", "b"], cl) for layer in bns)
    own = sum(allgather_cpu(8 + 16 * layer.out_shape[0], ["a", "b"], cl) for layer in bns)
    assert bn_sync_time(desc, 0, 6, ["a", "b"], cl) == pytest.approx(gathers)
    assert bn_sync_cpu(desc, 0, 6, ["a", "b"], cl) == pytest.approx(own)
    assert bn_sync_time(desc, 0, 6, ["a", "b"], cl, True) == pytest.approx(gathers + 4 * EXCHANGE_MESSAGES * 0.002)
    assert bn_sync_cpu(desc, 0, 6, ["a", "b"], cl, True) == pytest.approx(own + 4 * EXCHANGE_MESSAGES * 0.002)
    assert bn_sync_time(desc, 0, 6, ["a"], cl) == 0.0


def test_the_cpu_transfers_take_is_paid_by_a_busy_device_not_an_idle_one(lenet):
    """Moving bytes costs each end CPU (time per byte) even when the link sets the transfer's
    pace. A device waiting for its next input moves them in its idle time; one that goes
    straight on to the next micro-batch is slowed by them."""
    desc, mem = lenet
    bw = 1e6
    cl = cluster_of({"a": uniform_table(7, 0.1, 0.2), "b": uniform_table(7, 0.01, 0.02)}, bw=bw, latency=0.001)
    stages = [Stage(0, 3, "single", ["a"]), Stage(3, 7, "single", ["b"])]  # a is the bottleneck
    one = plan_of(stages, batch=1, micro=1, devices=("a", "b"))
    two = plan_of(stages, batch=2, micro=2, devices=("a", "b"))
    before = simulate(one, desc, mem, cl).step_time, simulate(two, desc, mem, cl).step_time
    cl.device("a").comm_s_per_byte = 0.5 / bw  # the link still sets the pace of every transfer
    n = mem.boundary(3)  # one sample's activation (and its gradient)
    assert simulate(one, desc, mem, cl).step_time == pytest.approx(before[0])  # a waits for b anyway
    grown = simulate(two, desc, mem, cl).step_time - before[1]
    assert 0.5 * n / bw - 1e-9 <= grown <= 4 * 0.5 * n / bw + 1e-9  # a's second forward pays for the first's send


def test_a_tiles_stage_pays_each_devices_tiles_overhead(lenet):
    """A tile's share of a layer's time is scaled by its device's tiles overhead (the
    executor's time over autograd's, profiled); the syncs are not."""
    from planner.simulator import stage_works
    from tiles.layout import tileable_prefix

    desc, mem = lenet
    n = 2  # conv and pool: maps large enough for two columns
    assert tileable_prefix(desc) >= n
    plan = plan_of([Stage(0, n, "tiles", ["a", "b"], grid=[1, 2], tile_devices=["a", "b"], syncs=list(range(n))),
                    Stage(n, 7, "single", ["a"])], batch=2, micro=1, devices=("a", "b"))
    clusters, works = [], []
    for overhead in (1.0, 2.0):
        table = uniform_table(7, 0.01, 0.02)
        table.tiles_overhead = overhead
        clusters.append(cluster_of({"a": table, "b": table}))  # kept: the stage cache tells clusters apart by id
        works.append(stage_works(plan, desc, mem, clusters[-1])[0])
    for kind in ("fwd", "bwd"):
        base, doubled = (getattr(w, kind)[0]["a"] for w in works)
        assert base > 0 and doubled == pytest.approx(2 * base)  # a free network: compute only


def test_replicas_with_uneven_shares_take_the_slowest_replicas_time(lenet):
    """Replica r runs its share of whole micro-batches on its own device, all at once: the step
    is the slowest replica's, and the shares are what evens uneven devices out."""
    desc, mem = lenet
    cl = cluster_of({"a": uniform_table(7, 0.01, 0.02), "b": uniform_table(7, 0.03, 0.06)})
    per_microbatch = {"a": 7 * 0.03, "b": 7 * 0.09}  # 1 sample each; b is three times slower
    even = plan_of([Stage(0, 7, "single", ["a", "b"], replicas=2)], batch=4, micro=4, devices=("a", "b"))
    uneven = plan_of([Stage(0, 7, "single", ["a", "b"], replicas=2, shares=[3, 1])], batch=4, micro=4,
                     devices=("a", "b"))
    t_even, t_uneven = simulate(even, desc, mem, cl), simulate(uneven, desc, mem, cl)
    assert t_even.step_time == pytest.approx(2 * per_microbatch["b"], rel=1e-6)
    assert t_uneven.step_time == pytest.approx(3 * per_microbatch["a"], rel=1e-6)   # a's 3 and b's 1 end together
    assert t_uneven.batch_size == 4 and set(t_uneven.peak_memory) == {"a", "b"}
    assert [uneven.replica_of(m) for m in range(4)] == [0, 0, 0, 1]


@pytest.mark.parametrize("shares,message", [([2, 1], "4 in all"), ([4, 0], "at least one"), ([1, 1, 2], "4 in all")])
def test_shares_that_do_not_cover_the_microbatches_are_refused(lenet, shares, message):
    desc, _ = lenet
    plan = plan_of([Stage(0, 7, "single", ["a", "b"], replicas=2, shares=shares)], batch=4, micro=4,
                   devices=("a", "b"))
    with pytest.raises(PlanError, match=message):
        plan.validate(desc)
    dp = plan_of([Stage(0, 7, "dp", ["a", "b"], allocation={"a": 1, "b": 0}, shares=[1])], devices=("a", "b"))
    with pytest.raises(PlanError, match="shares are for a stage with replicas"):
        dp.validate(desc)
    assert Plan.from_dict(plan.to_dict()).stages[0].shares == shares


def test_dp_deals_whole_microbatches_to_uneven_devices(lenet):
    """On devices of speeds 1, 1, 2, 2, 4 and 6 with 8 micro-batches of one sample, dp gives the
    fast devices more whole micro-batches and leaves out devices that would finish last."""
    from planner.baselines import deal_microbatches, plan_dp
    from planner.inputs import PlanInputs

    desc, mem = lenet
    speeds = {"s1": 1, "t1": 1, "s2": 2, "t2": 2, "s4": 4, "s6": 6}
    cl = cluster_of({d: uniform_table(7, 0.06 / v, 0.12 / v) for d, v in speeds.items()})
    inputs = PlanInputs(desc, mem, cl, 8, 8)
    group = cl.by_speed(inputs.microbatch)
    dealt = deal_microbatches(inputs, group)
    # one micro-batch takes 0.21 s on s6, 0.315 on s4, 0.63 on s2/t2 and 1.26 on s1/t1: dealt
    # one at a time to whoever finishes it first, s6 ends at 0.84 s, the others by 0.63
    assert dealt == {"s6": 4, "s4": 2, "s2": 1, "t2": 1}, dealt
    plan = plan_dp(inputs)
    stage = plan.stages[0]
    assert (stage.mode, stage.devices, stage.shares) == ("single", ["s6", "s4", "s2", "t2"], [4, 2, 1, 1]), stage
    even = plan_of([Stage(0, 7, "single", ["s6", "s4", "s2", "t2"], replicas=4)], batch=8, micro=8,
                   devices=tuple(speeds))
    assert plan.predicted["step_time_s"] < 0.75 * simulate(even, desc, mem, cl).step_time   # 0.84 s against 1.26



def test_dp_pools_small_devices_into_replica_groups(lenet):
    """Micro-batches of 4 samples on devices of speeds 1, 1, 2, 2, 4 and 6 where only the
    fastest holds a whole micro-batch and the others one sample each: dp pools them into
    replicas that are dp groups, (s6 3, s4 1) and (s2, t2, s1, t1 one each), taking the
    micro-batches as fast as each group finishes them, and every device works."""
    from planner.baselines import plan_dp
    from planner.inputs import PlanInputs

    desc, mem = lenet
    one = next(b for b in range(1, 2**34, 2**12) if mem.max_batch(0, 7, 1, b) >= 1)  # room for one sample
    four = next(b for b in range(one, 2**34, 2**12) if mem.max_batch(0, 7, 1, b) >= 4)
    speeds = {"s6": 6, "s4": 4, "s2": 2, "t2": 2, "s1": 1, "t1": 1}
    devs = [Device(d, uniform_table(7, 0.06 / v, 0.12 / v), four if d == "s6" else one) for d, v in speeds.items()]
    cl = Cluster(devs, np.full((6, 6), FAST), 0.0, None)
    plan = plan_dp(PlanInputs(desc, mem, cl, 32, 8))
    stage = plan.stages[0]
    assert stage.mode == "dp" and stage.replica_count() == 2, stage
    assert [stage.replica_devices(r) for r in range(2)] == [["s6", "s4"], ["s2", "t2", "s1", "t1"]]
    assert stage.allocation == {"s6": 3, "s4": 1, "s2": 1, "t2": 1, "s1": 1, "t1": 1}
    # a micro-batch takes the first group 0.63 s (s6's 3 samples) and the second 1.26 s: 6 and 2, or 5 and 3
    assert plan.predicted["step_time_s"] == pytest.approx(3.78, rel=0.02)
    alone = plan_of([Stage(0, 7, "single", ["s6"])], batch=32, micro=8, devices=tuple(speeds))
    assert plan.predicted["step_time_s"] < 0.6 * simulate(alone, desc, mem, cl).step_time
    # s4 on a link so slow that its share of the gradient ring would take longer than the
    # step: dp leaves it out, s6 takes whole micro-batches and the four small ones pool
    bw = np.full((6, 6), FAST)
    bw[1, :] = bw[:, 1] = 1e4
    slow = plan_dp(PlanInputs(desc, mem, Cluster(devs, bw, 0.0, None), 32, 8))
    stage = slow.stages[0]
    assert [stage.replica_devices(r) for r in range(stage.replica_count())] == [["s6"], ["s2", "t2", "s1", "t1"]]


def test_replica_groups_finish_as_soon_as_any_choice_of_runs(lenet):
    """The DP over runs of devices equals trying every set of disjoint runs (random times)."""
    import itertools

    from planner.baselines import _deal, _fastest_runs

    rng = np.random.default_rng(5)
    for _ in range(30):
        k, micro = int(rng.integers(2, 6)), int(rng.integers(2, 9))
        runs = {(i, j): (float(rng.uniform(0.2, 3.0)), {}) for i in range(k) for j in range(i + 1, k + 1)
                if rng.random() < 0.8}
        if not runs:
            continue

        def makespan(chosen):
            times = [runs[ij][0] for ij in chosen]
            shares = _deal(times, micro)
            return max(t * s for t, s in zip(times, shares))

        best = math.inf
        for size in range(1, k + 1):
            for chosen in itertools.combinations(runs, size):
                cells = [c for a, b in chosen for c in range(a, b)]
                if len(cells) == len(set(cells)):
                    best = min(best, makespan(chosen))
        got = _fastest_runs(runs, k, micro)
        assert got is not None and makespan(got) == pytest.approx(best), (runs, micro, got)


def test_a_sums_own_work_comes_out_of_each_devices_cpu(lenet):
    """The bytes a member sends and receives in a sum and its messages take its own time
    (comm_s_per_byte, msg_s), beside the sum's wall time over the link: on a device busy the
    whole step that time is added to the step; one with idle time to fit it in pays nothing
    more. Two replicas of one micro-batch each, the link fast: the sum's wall time is nothing."""
    from planner.stage_work import allreduce_cpu, allreduce_messages, gradient_buckets

    desc, mem = lenet
    cl = cluster_of({d: uniform_table(7, 0.01, 0.02) for d in "ab"})
    plan = plan_of([Stage(0, 7, "single", ["a", "b"], replicas=2)], batch=2, micro=2,
                   devices=("a", "b"))
    bare = simulate(plan, desc, mem, cl)
    nbytes, per_byte, per_message = float(mem.param_bytes.sum()), 2e-7, 3e-3
    for d in "ab":
        cl.device(d).comm_s_per_byte, cl.device(d).msg_s = per_byte, per_message
    own = 2 * 2 * (2 - 1) / 2 * nbytes * per_byte + gradient_buckets(mem, 0, 7) * allreduce_messages(2) * 2 * per_message
    assert allreduce_cpu(nbytes, ["a", "b"], cl, gradient_buckets(mem, 0, 7)) == pytest.approx({"a": own, "b": own})
    charged = simulate(plan, desc, mem, cl)
    assert charged.step_time == pytest.approx(bare.step_time + own)
    # b twice as fast: half its step idle, which its share of the sum fits in; a's is the step
    cl = cluster_of({"a": uniform_table(7, 0.01, 0.02), "b": uniform_table(7, 0.005, 0.01)})
    for d in "ab":
        cl.device(d).comm_s_per_byte, cl.device(d).msg_s = per_byte, per_message
    uneven = simulate(plan, desc, mem, cl)
    assert uneven.step_time == pytest.approx(bare.step_time + own)
    assert uneven.busy["b"] + own < uneven.step_time  # b's share of the sum fitted in its idle time


def test_the_cost_of_a_sum_counts_its_rounds_and_messages(lenet):
    """swarm sums over up to 8 members straight to each chunk's owner and back (2 rounds,
    2(g-1) messages), over larger groups of 2^k by halving and doubling (2k of each) and
    over others round a ring (2(g-1) of each): the same bytes."""
    from planner.stage_work import allreduce_messages, allreduce_rounds, ring_allreduce_time

    sizes = (1, 2, 3, 4, 6, 8, 12, 16)
    assert [allreduce_rounds(g) for g in sizes] == [0, 2, 2, 2, 2, 2, 22, 8]
    assert [allreduce_messages(g) for g in sizes] == [0, 2, 4, 6, 10, 14, 22, 8]
    lat, m = 0.002, 0.003
    table = uniform_table(7, 0.01, 0.02)
    names = [f"d{k}" for k in range(16)]
    cl = cluster_of({d: table for d in names}, latency=lat)
    for d in names:
        cl.device(d).msg_s = m
    assert ring_allreduce_time(1.0, names[:8], cl) == pytest.approx(2 * lat + 14 * 2 * m, rel=1e-6)
    assert ring_allreduce_time(1.0, names[:6], cl, buckets=3) == pytest.approx(2 * lat + 3 * 10 * 2 * m, rel=1e-6)
    assert ring_allreduce_time(1.0, names, cl) == pytest.approx(8 * lat + 8 * 2 * m, rel=1e-6)


def test_a_gang_that_overlaps_hides_its_syncs_behind_the_other_op_and_holds_one_more_micro_batch():
    """dp over two equal devices at one sample each, four micro-batches: F0 [B0 F1] [B1 F2]
    [B2 F3] B3. In each of the three pairs the backward's BatchNorm syncs hide behind the
    forward's compute and the forward's behind the backward's, each computing at OVERLAP_CPU
    times its cost alone; and during a paired backward the next forward's activations build
    up."""
    from planner.stage_work import OVERLAP_CPU

    desc = describe_model("yolov2-16", 64, 5)
    mem = MemoryModel.estimated(desc)
    n = len(desc.layers)
    lat = 0.01
    fwd, bwd = n * 0.01, n * 0.02  # a sample's forward and backward
    cl = cluster_of({"a": uniform_table(n, 0.01, 0.02), "b": uniform_table(n, 0.01, 0.02)}, latency=lat)
    stage = Stage(0, n, "dp", ["a", "b"], allocation={"a": 1, "b": 1})
    plain = simulate(Plan("yolov2-16", 64, 8, 4, [stage], devices={"a": {}, "b": {}}), desc, mem, cl)
    over = simulate(Plan("yolov2-16", 64, 8, 4, [replace(stage, overlap=True)], devices={"a": {}, "b": {}}),
                    desc, mem, cl)
    sync = sum(1 for layer in desc.layers if layer.batch_normalize) * lat  # one round of one message a BN layer
    assert sync < OVERLAP_CPU * fwd  # the other op's compute covers each sync
    pair_plain, pair_over = fwd + bwd + 2 * sync, OVERLAP_CPU * (fwd + bwd)
    assert over.step_time == pytest.approx(plain.step_time - 3 * (pair_plain - pair_over))
    assert over.step_time < plain.step_time
    assert over.peak_memory["a"] == pytest.approx(plain.peak_memory["a"] + mem.activations(0, n, 1))


def test_an_overlapped_gang_still_spends_its_syncs_cpu():
    """The same gang where each sync is only the members' own CPU (every message's handling,
    as on a device whose quota the messages spend, no latency): nothing beside it hides that,
    so each op of a pair costs its compute at OVERLAP_CPU plus its syncs in full, and
    overlapping is slower than not."""
    from planner.stage_work import OVERLAP_CPU

    desc = describe_model("yolov2-16", 64, 5)
    mem = MemoryModel.estimated(desc)
    n = len(desc.layers)
    fwd, bwd, msg = n * 0.01, n * 0.02, 0.005
    cl = Cluster([Device(d, uniform_table(n, 0.01, 0.02), 2**40, msg_s=msg) for d in ("a", "b")],
                 np.full((2, 2), FAST), 0.0)
    stage = Stage(0, n, "dp", ["a", "b"], allocation={"a": 1, "b": 1})
    plain = simulate(Plan("yolov2-16", 64, 8, 4, [stage], devices={"a": {}, "b": {}}), desc, mem, cl)
    over = simulate(Plan("yolov2-16", 64, 8, 4, [replace(stage, overlap=True)], devices={"a": {}, "b": {}}),
                    desc, mem, cl)
    sync = sum(1 for layer in desc.layers if layer.batch_normalize) * 2 * msg  # a message out and one in a BN layer
    pair_plain, pair_over = fwd + bwd + 2 * sync, OVERLAP_CPU * (fwd + bwd) + 2 * sync
    assert over.step_time == pytest.approx(plain.step_time - 3 * (pair_plain - pair_over))
    assert over.step_time > plain.step_time


def test_planners_overlap_a_gang_only_where_it_hides_more_than_it_costs_and_fits():
    from planner.inputs import PlanInputs

    desc = describe_model("yolov2-16", 64, 5)
    mem = MemoryModel.estimated(desc)
    n = len(desc.layers)
    table = uniform_table(n, 0.01, 0.02)
    stage = Stage(0, n, "dp", ["a", "b"], allocation={"a": 1, "b": 1})

    def planned(memory: float, latency: float = 0.01):
        inputs = PlanInputs(desc, mem, cluster_of({"a": table, "b": table}, latency=latency, memory=memory), 8, 4)
        return inputs.finish(inputs.plan([stage], "dp"))

    assert not planned(2**40, latency=0.0005).stages[0].overlap  # little to hide: not worth its CPU
    roomy = planned(2**40)
    assert roomy.stages[0].overlap and roomy.predicted["fits"]
    plain = roomy.predicted["peak_memory"]["a"] - mem.activations(0, n, 1)  # what it needs without overlapping
    tight = planned(plain - mem.budget(0, n, 0.0) + 1.0)
    assert tight.predicted["fits"] and not tight.stages[0].overlap
    assert tight.predicted["step_time_s"] > roomy.predicted["step_time_s"]


def test_dp_weighs_even_groups_beside_the_fastest_runs(lenet):
    """Eight equal devices that each hold two samples of a four-sample micro-batch, one sample
    a hair cheaper than half of two (as a profile may measure): the fastest runs in compute
    are two quartets, where four pairs would take 0.5% longer and exchange fewer BatchNorm
    sums, each with one partner. Which grouping wins is the simulator's to say, so every even
    cut of the devices is weighed beside the fastest runs."""
    from planner.baselines import _fastest_runs, plan_dp, replica_groups
    from planner.inputs import PlanInputs

    desc, mem = lenet
    two = next(b for b in range(1, 2**34, 2**12) if mem.max_batch(0, 7, 1, b) >= 2)
    assert mem.max_batch(0, 7, 1, two) < 4
    f, b = np.full((7, 2), 0.06), np.full((7, 2), 0.12)
    f[:, 1], b[:, 1] = 2 * 0.06 * 1.005, 2 * 0.12 * 1.005
    devs = [Device(f"d{k}", CostTable((1, 2), f, b, np.zeros(7), [0.0, 0.0], [0.0, 0.0]), two) for k in range(8)]
    cl = Cluster(devs, np.full((8, 8), FAST), 0.001, None)
    inputs = PlanInputs(desc, mem, cl, 32, 8)
    stages = replica_groups(inputs, cl.by_speed(inputs.microbatch))
    eights = [s.group_sizes() for s in stages if len(s.devices) == 8]
    assert [4, 4] in eights and [2, 2, 2, 2] in eights, eights
    chosen = plan_dp(inputs)
    for stage in stages:
        alone = inputs.finish(inputs.plan([stage], "dp"))
        assert chosen.predicted["step_time_s"] <= alone.predicted["step_time_s"] + 1e-9


def test_a_replicated_pipeline_stage_runs_each_replicas_own_micro_batches(lenet):
    """A pipeline whose first stage is two replicas taking two whole micro-batches each: every
    replica runs only its own, in the stage's schedule, each micro-batch goes on to the one
    device of the stage after it, and the front's backward of the last micro-batch is one
    replica's alone (the pipeline drains through a whole micro-batch on one device)."""
    desc, mem = lenet
    table = uniform_table(7, 0.01, 0.02)
    cl = cluster_of({"a": table, "b": table, "c": table})
    stages = [Stage(0, 4, "single", ["a", "b"], replicas=2), Stage(4, 7, "single", ["c"])]
    t = simulate(plan_of(stages, batch=4, micro=4), desc, mem, cl)
    mine = {d: [(e.kind, e.micro) for e in t.events if e.device == d and e.kind in "FB"] for d in "abc"}
    assert mine["a"] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # K_0 = 3 covers both forwards
    assert mine["b"] == [("F", 2), ("F", 3), ("B", 2), ("B", 3)]
    assert mine["c"] == [op for k in range(4) for op in (("F", k), ("B", k))]
    f0, b0, f1, b1 = 4 * 0.01, 4 * 0.02, 3 * 0.01, 3 * 0.02  # one sample a micro-batch: 4 layers, then 3
    # c starts once a's F0 is done and then never waits (a and b feed it in time); b's B3
    # starts once c's B3 is done, and ends the step
    assert t.step_time == pytest.approx(f0 + 4 * (f1 + b1) + b0, rel=1e-6)
    # in turns, a takes micro-batches 0 and 2, b 1 and 3: b's last backward follows c's B3 as
    # before, but a's B2 no longer waits behind its B1, nor b's B3 behind its B2
    turns = [Stage(0, 4, "single", ["a", "b"], replicas=2, deal="turns"), Stage(4, 7, "single", ["c"])]
    t2 = simulate(plan_of(turns, batch=4, micro=4), desc, mem, cl)
    mine = {d: [(e.kind, e.micro) for e in t2.events if e.device == d and e.kind in "FB"] for d in "ab"}
    assert mine == {"a": [("F", 0), ("F", 2), ("B", 0), ("B", 2)], "b": [("F", 1), ("F", 3), ("B", 1), ("B", 3)]}
    assert t2.step_time == pytest.approx(t.step_time, rel=1e-6)  # c paces both: the same end
    assert [Stage(0, 4, "single", ["a", "b"], replicas=2, shares=[3, 1], deal="turns").replica_order(4)] == \
        [[0, 1, 0, 0]]
    gangs = plan_of([Stage(0, 4, "dp", ["a", "b", "c"], allocation={"a": 1, "b": 1, "c": 2}, replicas=2,
                           groups=[2, 1]), Stage(4, 7, "single", ["c"])], batch=8, micro=4)
    with pytest.raises(PlanError, match="replicas of dp groups of several devices are costed only in a one-stage plan"):
        simulate(gangs, desc, mem, cl)


def test_the_replicated_search_finds_the_fastest_pipeline_of_replicated_stages(lenet):
    """Every pipeline of replicated stages over three devices (in speed order, each stage the
    next few) and four micro-batches, simulated: the search's plan is the fastest, and its
    replicas' shares even out their devices. The front layers hold most of the work, so the
    fastest pipeline replicates them."""
    import itertools

    from planner.inputs import PlanInputs
    from planner.replicated import plan_replicated, shares_for

    desc, mem = lenet

    def front_heavy(speed: float) -> CostTable:
        table = uniform_table(7, 0.01 / speed, 0.02 / speed)
        table.fwd[4:] /= 10
        table.bwd[4:] /= 10
        return table

    cl = cluster_of({"a": front_heavy(1.0), "b": front_heavy(1.0), "c": front_heavy(0.8)}, bw=1e6, latency=1e-3)
    inputs = PlanInputs(desc, mem, cl, 4, 4)
    order = cl.by_speed(1)
    best = None
    for p in (2, 3):
        for cuts in itertools.combinations(range(1, 7), p - 1):
            bounds = [0, *cuts, 7]
            for sizes in itertools.product(range(1, 4), repeat=p):
                if sum(sizes) > 3:
                    continue
                stages, start = [], 0
                for (first, last), k in zip(zip(bounds, bounds[1:]), sizes):
                    names = order[start:start + k]
                    times = [cl.device(d).costs.range_time(first, last, 1, last == 7) for d in names]
                    stages.append(Stage(first, last, "single", names) if k == 1 else
                                  Stage(first, last, "single", names, replicas=k, shares=shares_for(times, 4),
                                        deal="turns"))
                    start += k
                step = simulate(inputs.plan(stages, "brute"), desc, mem, cl).step_time
                best = step if best is None else min(best, step)
    found = plan_replicated(inputs)
    assert found.predicted["step_time_s"] == pytest.approx(best, rel=1e-9)
    assert found.stages[0].replicas == 2 and found.stages[0].shares == [2, 2]
    assert shares_for([1.0, 2.0], 8) == [6, 2] and shares_for([1.0, 1.0, 1.0], 4) == [2, 1, 1]


def test_the_replicated_search_gives_way_to_a_step_it_cannot_beat(lenet):
    """Given auto's best step so far, the search leaves out the stages whose devices alone take
    longer, and answers None (not "nothing fits") when that leaves nothing."""
    from planner.inputs import NoPlan, PlanInputs
    from planner.replicated import plan_replicated

    desc, mem = lenet
    cl = cluster_of({d: uniform_table(7, 0.01, 0.02) for d in "abc"})
    inputs = PlanInputs(desc, mem, cl, 4, 4)
    found = plan_replicated(inputs)
    assert found is not None and plan_replicated(inputs, bound=found.predicted["step_time_s"]) is None
    assert plan_replicated(inputs, bound=1e-6) is None
    tiny = cluster_of({d: uniform_table(7, 0.01, 0.02) for d in "abc"}, memory=1.0)
    with pytest.raises(NoPlan, match="fits the devices' memory"):
        plan_replicated(PlanInputs(desc, mem, tiny, 4, 4))


# A 0.2-core testbed device's profile of yolov2-16 at 416, one sample a pass (seconds per layer;
# bench/RESULTS.md, 2026-12-04 22:17), and its lanes' measured costs over a 100 Mbit link
TESTBED_FWD = [0.0944, 0.1361, 0.1201, 0.0437, 0.0959, 0.0245, 0.0956, 0.0211, 0.0807, 0.0194, 0.086, 0.0088,
               0.0829, 0.0159, 0.0823, 0.0154, 0.0033]
TESTBED_BWD = [0.0725, 0.0572, 0.2061, 0.0238, 0.1823, 0.0359, 0.1808, 0.0096, 0.1636, 0.0261, 0.1633, 0.0053,
               0.1683, 0.0231, 0.1663, 0.0272, 0.0044]
TESTBED_UPDATE = [0.0002, 0.0, 0.00045, 0.0, 0.00076, 0.0005, 0.00059, 0.0, 0.00174, 0.00027, 0.0011, 0.0, 0.00802,
                  0.00051, 0.00819, 0.00048, 0.0002]


def eight_testbed_devices(batch: int):
    from planner.inputs import PlanInputs
    desc = describe_model("yolov2-16", 416)
    table = CostTable((1,), np.array(TESTBED_FWD), np.array(TESTBED_BWD), np.array(TESTBED_UPDATE), [0.012], [0.004])
    devices = [Device(f"dev{i}", table, 2**30, lane_s_per_byte=6.04e-9, lane_msg_s=7.4e-4) for i in range(8)]
    names = [d.name for d in devices]
    plan = Plan("yolov2-16", 416, batch, 8, [Stage(0, len(desc.layers), "single", names, replicas=8)],
                devices={d: {} for d in names})
    return PlanInputs(desc, MemoryModel.estimated(desc), Cluster(devices, np.full((8, 8), 12.0e6), 7e-4), batch, 8), plan


def test_the_sums_go_first_where_the_next_forward_needs_them_first():
    """yolov2-16's top two buckets (layers 16-14 and 13-12) hold three quarters of its
    weights. Summed top layer first, they keep the lanes busy while the bottom bucket, which
    the next forward needs first, waits its turn: on eight 0.2-core devices at batch 8 the
    cost model sums 16-14, then what the next forward needs from the bottom up, and 13-12
    last, where the forward reaches it late. At batch 32 the forward is long enough to hide
    every order, and the plan keeps the backward's."""
    inputs, plan = eight_testbed_devices(8)
    assert [b[0] for b in buckets_of({i: int(b) for i, b in enumerate(inputs.mem.param_bytes) if b > 0})] == \
        [16, 13, 10, 9, 6]
    top_first = inputs.simulate(plan)
    ordered = inputs.with_sum_orders(Plan.from_dict(plan.to_dict()), top_first)
    assert ordered.stages[0].sum_order == [16, 10, 9, 6, 13]
    assert ordered.predicted["step_time_s"] < 0.95 * top_first.step_time
    assert ordered.predicted["step_time_s"] == pytest.approx(inputs.simulate(ordered).step_time)
    assert "gradients summed in the order 16,10,9,6,13" in ordered.describe()
    # each order priced per gate: the reversed one, bottom bucket first, is no better than the chosen
    reversed_ = Plan.from_dict(ordered.to_dict())
    reversed_.stages[0].sum_order = [6, 9, 10, 13, 16]
    assert inputs.simulate(reversed_).step_time > ordered.predicted["step_time_s"]
    long_forward, plan = eight_testbed_devices(32)
    assert long_forward.with_sum_orders(plan).stages[0].sum_order is None


@pytest.mark.parametrize("order, message", [
    ([16, 13, 10, 9], "must order the stage's gradient buckets, named by their top layers: 16, 13, 10, 9, 6"),
    ([16, 13, 10, 9, 5], "must order the stage's gradient buckets"),
    ([16, 16, 10, 9, 6], "must list distinct layers of the stage"),
    ([17, 13, 10, 9, 6], "must list distinct layers of the stage"),
    ("16,13", "must list distinct layers of the stage"),
])
def test_a_sum_order_that_is_not_the_stages_buckets_is_one_line(order, message):
    desc = describe_model("yolov2-16", 416)
    plan = Plan.from_dict({"model": "yolov2-16", "img_size": 416, "batch_size": 2, "microbatches": 2,
                           "stages": [{"first": 0, "last": 17, "mode": "single", "devices": ["a", "b"], "replicas": 2,
                                       "sum_order": order}]})
    with pytest.raises(PlanError, match=message) as raised:
        plan.validate(desc)
    assert "\n" not in str(raised.value)
    tiles = Plan.from_dict({**plan.to_dict(), "stages": [{"first": 0, "last": 17, "mode": "tiles", "devices": ["a"],
                                                          "grid": [1, 1], "tile_devices": ["a"], "sum_order": [16]}]})
    with pytest.raises(PlanError, match="sum_order is for single and dp stages"):
        tiles.validate(desc)


def swarm_like_testbed(speeds: dict[str, float], memory: dict[str, float] | None = None, batch: int = 32):
    """Devices `speeds` times the 0.2-core testbed device above (yolov2-16 at 416, 100 Mbit),
    each with 1 GiB or `memory` bytes, planned with the papers' memory model."""
    from planner.inputs import PlanInputs
    desc = describe_model("yolov2-16", 416)
    table = CostTable((1,), np.array(TESTBED_FWD), np.array(TESTBED_BWD), np.array(TESTBED_UPDATE), [0.012], [0.004])
    devices = [Device(d, table.scaled(s), (memory or {}).get(d, 2**30), lane_s_per_byte=6.04e-9 / s,
                      lane_msg_s=7.4e-4 / s) for d, s in speeds.items()]
    n = len(devices)
    return PlanInputs(desc, MemoryModel.estimated(desc), Cluster(devices, np.full((n, n), 12.0e6), 7e-4), batch, 8)


def test_whole_micro_batches_set_the_mixed_swarms_floor_and_auto_plans_at_it():
    """The mixed testbed (0.1, 0.1, 0.2, 0.2, 0.4 and 0.6 core) at batch 32 in 8. No device
    takes part of a micro-batch of 4 without a group that exchanges BatchNorm sums, so the
    least step of any plan of whole-model replicas, computing only, lies above the summed
    rates' (where the batch divides perfectly, as with speeds in proportion to the cores, the
    two the same). With those speeds, the two 0.1-core devices split one micro-batch while
    the 0.6-core device runs three. Where the 0.1-core devices are 2.5x slower than a 0.2-core
    one rather than 2x (as the planner took the mixed testbed's profiles while it charged the
    runtime 0.022 cores: a micro-batch of 4 in 28.3-29.1 s against 11.3-11.6; bench/RESULTS.md,
    2026-12-05 09:09), they would take longer even split between the two than the 0.6-core
    device for four, and they are left out. `auto` plans the floor's groups both times, its
    step over the floor by what the sums add."""
    from planner.bounds import replica_floor, sample_rate, samples_floor
    from planner.planners import make_plan
    cases = [({"dev0": 0.5, "dev1": 0.5, "dev2": 1, "dev3": 1, "dev4": 2, "dev5": 3},
              [(("dev0", "dev1"), 1, (2, 2)), (("dev2",), 1, (4,)), (("dev3",), 1, (4,)), (("dev4",), 2, (4,)),
               (("dev5",), 3, (4,))]),
             ({"dev0": 0.394, "dev1": 0.405, "dev2": 0.984, "dev3": 1.016, "dev4": 2.27, "dev5": 3.35},
              [(("dev2",), 1, (4,)), (("dev3",), 1, (4,)), (("dev4",), 2, (4,)), (("dev5",), 4, (4,))])]
    for speeds, groups in cases:
        inputs = swarm_like_testbed(speeds)
        n = inputs.num_layers
        costs = {d.name: d.costs for d in inputs.cluster.devices}
        floor = replica_floor(inputs)
        assert sorted(floor.groups) == groups
        busiest = max(k * max(costs[d].range_time(0, n, s, True) for d, s in zip(g, split))
                      + max(costs[d].update_range(0, n) for d in g) for g, k, split in groups)
        assert floor.step == pytest.approx(busiest)
        everyone = samples_floor(inputs, sum(sample_rate(inputs, d) for d in costs))
        assert everyone <= floor.step
        if "dev0" not in auto_devices(groups):  # what whole micro-batches cost as measured
            assert everyone < 0.93 * floor.step
        auto = make_plan("auto", inputs)
        stage = auto.stages[0]
        assert len(auto.stages) == 1 and sorted(auto.used_devices()) == auto_devices(groups)
        assert sorted(stage.replica_shares(8)) == sorted(k for _, k, _ in groups)
        assert floor.step <= auto.predicted["step_time_s"] <= 1.08 * floor.step
    # the slower 0.1-core devices, splitting one micro-batch: longer than the floor's step
    assert costs["dev0"].range_time(0, n, 2, True) > floor.step


def test_groups_of_whole_micro_batches_are_chosen_with_their_exchanges_counted():
    """The mixed testbed as its survey read it (2026-12-05 11:55 UTC): each device's time a
    sample at 1, 2 and 4 samples, its messages' handling and its sums' CPU under its quota. The
    0.1-core devices' profiles read a sample alone faster than each of two (dev0 5.11 against
    5.41 s), so by compute alone the fastest groups put them with a 0.2-core device, a sample
    each, taking two micro-batches: three members exchanging BatchNorm sums at every layer of
    two micro-batches at the 0.1-core devices' pace, the plan then slower than pairs all round.
    Counting a group's exchanges in its time for a micro-batch (as the simulator costs it), the
    search finds the plan the testbed ran fastest (3.25x DDP, bench/RESULTS.md 2026-12-05
    10:13): the two 0.1-core devices split one micro-batch, the others take whole ones."""
    from dataclasses import replace

    from planner.planners import make_plan
    from planner.stage_work import group_microbatch_time
    f, b, u = np.array(TESTBED_FWD), np.array(TESTBED_BWD), np.array(TESTBED_UPDATE)
    one = sum(TESTBED_FWD) + sum(TESTBED_BWD) + 0.016  # a sample, with the loss head
    per_sample = {"dev0": (5.109, 5.414, 5.567), "dev1": (5.201, 5.262, 5.292), "dev2": (2.535, 2.45, 2.407),
                  "dev3": (2.542, 2.46, 2.419), "dev4": (1.262, 1.197, 1.164), "dev5": (0.814, 0.822, 0.826)}
    msg = {"dev0": 5.5e-3, "dev1": 5.7e-3, "dev2": 2.1e-3, "dev3": 2.3e-3, "dev4": 8.1e-4, "dev5": 3.1e-4}
    quota = {"dev0": 0.1, "dev1": 0.1, "dev2": 0.2, "dev3": 0.2, "dev4": 0.4, "dev5": 0.6}
    inputs = swarm_like_testbed(dict.fromkeys(per_sample, 1.0))
    devices = []
    for d in inputs.cluster.devices:
        k = np.array([n * t / one for n, t in zip((1, 2, 4), per_sample[d.name])])
        table = CostTable((1, 2, 4), np.outer(f, k), np.outer(b, k), u * per_sample[d.name][0] / one,
                          list(0.012 * k), list(0.004 * k))
        q = quota[d.name]
        devices.append(replace(d, costs=table, msg_s=msg[d.name], comm_s_per_byte=3.4e-9 / q, step_s=0.06 / q,
                               lane_s_per_byte=1.2e-9 / q, lane_msg_s=1.5e-4 / q))
    inputs = replace(inputs, cluster=replace(inputs.cluster, devices=devices))
    cl, n = inputs.cluster, inputs.num_layers
    trio, pair = {"dev3": 2, "dev1": 1, "dev0": 1}, {"dev1": 2, "dev0": 2}
    # two micro-batches on the three-device group take less than one on the pair by compute ...
    by_compute = [max(cl.device(d).costs.range_time(0, n, y, True) for d, y in g.items()) for g in (trio, pair)]
    assert 2 * by_compute[0] < by_compute[1]
    # ... and not with their exchanges
    with_exchanges = [group_microbatch_time(inputs.desc, cl, g, 0, n, True) for g in (trio, pair)]
    assert 2 * with_exchanges[0] > with_exchanges[1]
    auto = make_plan("auto", inputs)
    stage = auto.stages[0]
    groups = [stage.replica_devices(r) for r in range(stage.replica_count())]
    assert len(auto.stages) == 1 and sorted(map(sorted, groups)) == [["dev0", "dev1"], ["dev2"], ["dev3"], ["dev4"],
                                                                     ["dev5"]]
    assert sorted(stage.replica_shares(8)) == [1, 1, 1, 2, 3]
    # pairs all round, the plan a search by compute alone ended with, is slower
    pairs = inputs.plan([Stage(0, n, "dp", ["dev5", "dev4", "dev2", "dev3", "dev1", "dev0"],
                               allocation=dict.fromkeys(["dev5", "dev4", "dev2", "dev3", "dev1", "dev0"], 2),
                               replicas=3, groups=[2, 2, 2], shares=[5, 2, 1])], "dp")
    assert auto.predicted["step_time_s"] < inputs.simulate(pairs).step_time


def auto_devices(groups) -> list[str]:
    return sorted(d for g, _, _ in groups for d in g)


def test_the_replica_floor_splits_micro_batches_where_no_device_holds_one():
    """Four equal devices that each hold 2 samples of the whole model, not 4: every plan of
    whole-model replicas puts them in pairs, each pair splitting its micro-batches 2 and 2,
    and the floor is a pair's four micro-batches. With room for 4 each, every device runs two
    micro-batches alone. With room for 1, the four run every micro-batch together, a sample
    each; three such devices cannot hold one."""
    from planner.bounds import replica_floor
    probe = swarm_like_testbed({"a": 1})
    n, mem = probe.num_layers, probe.mem
    two = mem.stage(0, n, 2, 1) * 1.01
    assert mem.max_batch(0, n, 1, two) == 2
    inputs = swarm_like_testbed({d: 1 for d in "abcd"}, {d: two for d in "abcd"})
    costs = inputs.cluster.device("a").costs
    floor = replica_floor(inputs)
    assert sorted(split for _, _, split in floor.groups) == [(2, 2), (2, 2)]
    assert sorted(k for _, k, _ in floor.groups) == [4, 4]
    assert floor.step == pytest.approx(4 * costs.range_time(0, n, 2, True) + costs.update_range(0, n))
    roomy = replica_floor(swarm_like_testbed({d: 1 for d in "abcd"}))
    assert [(k, split) for _, k, split in roomy.groups] == [(2, (4,))] * 4
    assert roomy.step == pytest.approx(2 * costs.range_time(0, n, 4, True) + costs.update_range(0, n))
    one = mem.stage(0, n, 1, 1) * 1.01
    single = replica_floor(swarm_like_testbed({d: 1 for d in "abcd"}, {d: one for d in "abcd"}))
    assert single.groups == [(("a", "b", "c", "d"), 8, (1, 1, 1, 1))]
    assert single.step == pytest.approx(8 * costs.range_time(0, n, 1, True) + costs.update_range(0, n))
    assert replica_floor(swarm_like_testbed({d: 1 for d in "abc"}, {d: one for d in "abc"})) is None
    # more devices than the search goes through: no floor
    assert replica_floor(swarm_like_testbed({f"d{i}": 1 for i in range(9)})) is None
