"""Plans whose stages run in checkpointed segments (Stage.checkpoint, planner.checkpoint): what
the memory model says they keep and hold, one more forward in the backward, `auto`
checkpointing where memory held its plan back and not where it did not, and the plan's
field in JSON and validation. No training here (tests/test_checkpoint.py runs the nets)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.checkpoint import checkpointing, checkpointing_model, kept_bytes, stage_segments
from planner.inputs import PlanInputs
from planner.memory import MemoryModel, estimate_activation_bytes
from planner.plan import Plan, PlanError, Stage
from planner.planners import _plan_auto, plan_auto
from planner.recompute import recomputing
from planner.report import stage_devices
from planner.simulator import simulate
from planner.synthetic import flops_cluster
from swarm.zoo import describe_model

TINY = str(Path(__file__).resolve().parent / "cfg" / "darknet" / "yolov4-tiny.cfg")
MiB = 2**20


@pytest.fixture(scope="module")
def yolov2():
    return describe_model("yolov2-16", 416)


@pytest.fixture(scope="module")
def tiny():
    return describe_model(TINY, 256)


def _ranges(n: int) -> list[tuple[int, int]]:
    """The whole model, a front, a back and a few stages in the middle (some starting inside a segment)."""
    return [(0, n), (0, n // 3), (n // 3, n), (1, n - 1), (n // 4, n // 2), (n // 2, n // 2 + 1)]


@pytest.mark.parametrize("which", ["yolov2", "tiny"])
def test_a_checkpointing_stage_keeps_the_maps_crossing_its_segments_starts(which, request):
    desc = request.getfixturevalue(which)
    n = len(desc.layers)
    for mem in (MemoryModel.estimated(desc), MemoryModel.for_devices(desc, "sgd"),
                MemoryModel.for_devices(desc, "sgd", allocator="jemalloc")):
        ck = checkpointing_model(mem)
        assert ck.checkpointed and checkpointing_model(ck) is ck and not mem.checkpointed
        for first, last in _ranges(n):
            for batch in (1, 3):
                assert ck.activations(first, last, batch) == pytest.approx(
                    batch * mem.slack * mem.share_factor(batch) * kept_bytes(desc, first, last))
                # its backward holds, beyond that, its worst segment remade whole with that
                # segment's backward buffers (the plain model's saved bytes and transient there);
                # where the allocator reuses freed room, less the maps only later segments read,
                # freed by then (those a stage ending with the segment would not keep)
                per_byte = batch * mem.slack * mem.share_factor(batch)
                worst = max(mem.activations(a, b, batch) + mem.transient(a, b, batch)
                            - (per_byte * (kept_bytes(desc, first, last) - kept_bytes(desc, first, b)) if mem.reuse
                               else 0.0)
                            for a, b in stage_segments(desc, first, last))
                assert ck.transient(first, last, batch) == pytest.approx(worst)
                assert ck.buffers(first, last, batch) >= ck.transient(first, last, batch)
            # what does not depend on the maps is the plain model's
            assert ck.weights(first, last) == mem.weights(first, last)
            assert ck.budget(first, last, 1e9) == mem.budget(first, last, 1e9)
            need = 2 * ck.activations(first, last, 1) + ck.transient(first, last, 1)
            assert ck.stage(first, last, 1, 2) == pytest.approx(ck.weights(first, last) + need)
            room = ck.weights(first, last) + 5 * need - ck.budget(first, last, 0.0)
            assert ck.max_batch(first, last, 2, room) == 5


def test_measured_saved_bytes_charge_the_segment_remade_not_the_kept_maps(yolov2):
    """With a profile's saved bytes (here 1.2x the estimate), a checkpointing stage still keeps
    the maps' own sizes (kept_bytes), and its worst segment is charged what was measured."""
    n = len(yolov2.layers)
    measured = 1.2 * np.array(estimate_activation_bytes(yolov2), dtype=float)
    mem = MemoryModel.for_devices(yolov2, "sgd", act_bytes=measured)
    ck = checkpointing_model(mem)
    assert ck.measured
    assert ck.activations(0, n, 2) == pytest.approx(2 * mem.slack * kept_bytes(yolov2, 0, n))
    assert ck.transient(0, n, 2) == pytest.approx(max(mem.activations(a, b, 2) + mem.transient(a, b, 2)
                                                      for a, b in stage_segments(yolov2, 0, n)))


def test_checkpointing_keeps_less_than_remaking_and_keeping_everything(yolov2):
    """yolov2-16 at 416, per sample (the figures in docs/planner.md): kept until the backward,
    125.3 MiB keeping every map, 69.8 remaking BatchNorm, 28.4 checkpointing; what a device
    planned with the testbed's allocator (glibc, slack 1.15) needs for one micro-batch of
    the whole model, backward included, 219, 131 and 159 MiB: remaking's two largest layers
    back-propagate a few channels at a time (swarm.zoo.recompute), where the first checkpointed
    segment's backward holds their whole maps. With four micro-batches in flight (a pipeline's
    front) checkpointing holds the least: 257, 372 and 651 MiB."""
    n = len(yolov2.layers)
    for mem in (MemoryModel.estimated(yolov2), MemoryModel.for_devices(yolov2, "sgd")):
        keep, remake, ck = (m.activations(0, n, 1) for m in (mem, mem.recomputing(), checkpointing_model(mem)))
        assert ck < 0.5 * remake < 0.3 * keep
    assert [round(m.activations(0, n, 1) / MiB, 1) for m in (mem, mem.recomputing(), checkpointing_model(mem))] == [
        144.1, 80.3, 32.6]  # (x1.15)
    models = (mem, mem.recomputing(), checkpointing_model(mem))
    need = [m.activations(0, n, 1) + m.transient(0, n, 1) for m in models]
    assert need[1] < need[2] < need[0]
    assert [round(x / MiB) for x in need] == [219, 131, 159]
    held = [4 * m.activations(0, n, 1) + m.transient(0, n, 1) for m in models]
    assert held[2] < held[1] < held[0]
    with pytest.raises(ValueError, match="not both"):
        checkpointing_model(mem).recomputing()
    with pytest.raises(ValueError, match="not both"):
        checkpointing_model(mem.recomputing())


def test_the_backward_of_a_checkpointing_stage_runs_its_forward_once_more(yolov2):
    """One device, the whole model, batch 8 in 4: its busy time checkpointing is its busy time
    keeping every map plus one forward of the model per micro-batch, to the float."""
    n = len(yolov2.layers)
    mem = MemoryModel.for_devices(yolov2, "sgd")
    cluster = flops_cluster(yolov2, {"d0": (50, "4 GiB")})
    plain = Plan("yolov2-16", 416, 8, 4, [Stage(0, n, "single", ["d0"])])
    ck = Plan.from_dict(plain.to_dict())
    ck.stages[0].checkpoint = True
    busy = [simulate(p, yolov2, mem, cluster).busy["d0"] for p in (plain, ck)]
    forward = cluster.device("d0").costs.fwd_range(0, n, 2)
    assert busy[1] - busy[0] == pytest.approx(4 * forward, rel=1e-9)
    assert forward > 0.2 * busy[0] / 4  # (a forward is a fair part of a micro-batch's work)
    # the same costs from checkpointing() itself, which does not charge twice
    m2, c2 = checkpointing(mem, cluster, yolov2)
    assert c2.checkpointing and not cluster.checkpointing
    m3, c3 = checkpointing(m2, c2, yolov2)
    assert m3 is m2 and c3 is c2
    costs, again = cluster.device("d0").costs, c2.device("d0").costs
    assert np.allclose(again.bwd, costs.bwd + costs.fwd) and np.array_equal(again.fwd, costs.fwd)
    assert c2.subset(["d0"]).checkpointing
    with pytest.raises(ValueError, match="not both"):
        checkpointing(mem, recomputing(mem, cluster, yolov2)[1], yolov2)


def test_pipelines_and_one_device_replicas_checkpoint(tiny):
    """A pipeline of single stages and a dp stage of one-device replicas simulate checkpointed:
    more time, and less memory at the peak of each device whose stage keeps several
    micro-batches or several segments. The pipeline's last stage keeps one micro-batch, of one
    segment (layers 25-37), which it remakes whole: it holds more, by the maps it kept (the
    segment's saved bytes are charged whole, its inputs with them)."""
    n = len(tiny.layers)
    mem = MemoryModel.for_devices(tiny, "sgd")
    cluster = flops_cluster(tiny, {f"d{i}": (20, "2 GiB") for i in range(3)})
    plans = [Plan(tiny.name, 256, 12, 6, [Stage(0, 10, "single", ["d0"]), Stage(10, 25, "single", ["d1"]),
                                          Stage(25, n, "single", ["d2"])]),
             Plan(tiny.name, 256, 12, 3, [Stage(0, n, "dp", ["d0", "d1", "d2"], allocation={"d0": 4, "d1": 4, "d2": 4},
                                                replicas=3, groups=[1, 1, 1])])]
    for plain in plans:
        ck = Plan.from_dict(plain.to_dict())
        for s in ck.stages:
            s.checkpoint = True
        ck.validate(tiny)
        a, b = simulate(plain, tiny, mem, cluster), simulate(ck, tiny, mem, cluster)
        assert b.step_time > a.step_time
        for d in a.peak_memory:
            if d == "d2" and len(ck.stages) > 1:
                assert stage_segments(tiny, 25, n) == [(25, n)] and ck.warmups()[2] == 1
                more = 2 * mem.slack * kept_bytes(tiny, 25, n)
                assert b.peak_memory[d] - a.peak_memory[d] == pytest.approx(more)
            else:
                assert b.peak_memory[d] < a.peak_memory[d], d


def _scenario(desc):
    """Four 50 GFLOP/s devices of yolov4-tiny at 608 with 100 Mbit/s links of 50 ms latency (a
    slow radio), batch 16 in 8 micro-batches of 2, each device's budget halfway between what two
    samples of the whole model need checkpointing and remaking, from the models themselves
    (MemoryModel.for_devices, less the job's reserve that a whole-model stage gets: 32 and 72
    MiB, 196 keeping every map, so 52). The roomy budget is 1.25x what two samples need keeping
    every map (245 MiB). (yolov2-16 at 416 no longer serves: its two largest layers
    back-propagate a few channels at a time remaking, which then needs less than checkpointing,
    131 MiB a sample against 159.)"""
    n = len(desc.layers)
    mem = MemoryModel.for_devices(desc, "sgd")

    def need(m, samples):  # budget for `samples` of the whole model on one device
        return m.stage(0, n, samples, 1) - m.budget(0, n, 0.0)

    tight = (need(checkpointing_model(mem), 2) + need(mem.recomputing(), 2)) / 2
    roomy = 1.25 * need(mem, 2)
    return mem, n, tight, roomy


def test_auto_checkpoints_where_memory_held_its_plan_back_and_not_where_it_did_not():
    """With the tight budget (_scenario) no device holds a whole micro-batch of 2 samples keeping
    every map nor remaking, so those searches split each micro-batch over a dp group of two, whose
    BatchNorm sums cross the 50 ms links at every layer; checkpointing, each device takes whole
    micro-batches (four replicas), one more forward each for no exchange. With room for two
    samples keeping every map (1.25x what they need), auto neither checkpoints nor remakes."""
    desc = describe_model("yolov4-tiny", 608)
    mem, n, tight, roomy = _scenario(desc)
    cluster = flops_cluster(desc, {f"d{i}": (50, f"{int(tight)}") for i in range(4)}, latency_ms=50)
    inputs = PlanInputs(desc, mem, cluster, 16, 8)
    keeping, plan = _plan_auto(inputs), plan_auto(inputs)
    m2, c2 = recomputing(mem, cluster, desc)
    remaking = _plan_auto(replace(inputs, mem=m2, cluster=c2), remaking=True)
    for other in (keeping, remaking):  # held back: groups sharing each micro-batch
        assert other.stages[0].mode == "dp" and max(other.stages[0].group_sizes()) > 1
    assert plan.checkpoints() and not plan.recomputes()
    assert all(s.checkpoint for s in plan.stages)
    stage = plan.stages[0]
    assert stage.mode == "single" and stage.replica_count() == 4
    again = simulate(plan, desc, mem, cluster)
    assert again.fits and again.step_time == pytest.approx(plan.predicted["step_time_s"])
    assert again.step_time < 0.9 * min(keeping.predicted["step_time_s"], remaking.predicted["step_time_s"])
    # the same plan keeping every map, or remaking, would not fit
    for field in ("checkpoint", "recompute"):
        other = Plan.from_dict(plan.to_dict())
        other.stages[0].checkpoint = None
        setattr(other.stages[0], field, None if field == "checkpoint" else True)
        assert not simulate(other, desc, mem, cluster).fits, field
    assert "checkpointed in segments" in stage_devices(stage)
    roomy_cluster = flops_cluster(desc, {f"d{i}": (50, f"{int(roomy)}") for i in range(4)}, latency_ms=50)
    plain = plan_auto(PlanInputs(desc, mem, roomy_cluster, 16, 8))
    assert not plain.checkpoints() and not plain.recomputes()
    assert plain.stages[0].replica_count() == 4 and plain.stages[0].mode == "single"


def test_a_plan_names_its_checkpointing_and_what_may_not_checkpoint_is_refused():
    plan = Plan("yolov2-16", 64, 8, 2, [Stage(0, 16, "dp", ["d0", "d1"], allocation={"d0": 4, "d1": 4},
                                              replicas=2, groups=[1, 1], checkpoint=True)])
    again = Plan.from_json(plan.to_json())
    assert again.stages[0].checkpoint is True and again.checkpoints() and not again.recomputes()
    again.validate()
    refused = {
        "tiles": Stage(0, 16, "tiles", ["d0", "d1"], grid=(1, 2), tile_devices=["d0", "d1"], checkpoint=True),
        "dp group": Stage(0, 16, "dp", ["d0", "d1"], allocation={"d0": 2, "d1": 2}, checkpoint=True),
        "recompute": Stage(0, 16, "single", ["d0"], checkpoint=True, recompute=True),
    }
    for what, stage in refused.items():
        with pytest.raises(PlanError) as exc:
            Plan("yolov2-16", 64, 8, 2, [stage]).validate()
        assert "\n" not in str(exc.value), what
        assert ("one or the other" if what == "recompute" else "whole micro-batches") in str(exc.value), what
    # a plan of one stage remaking and another checkpointing is not simulated
    desc = describe_model("yolov2-16", 64)
    mixed = Plan("yolov2-16", 64, 8, 2, [Stage(0, 8, "single", ["d0"], recompute=True),
                                         Stage(8, len(desc.layers), "single", ["d1"], checkpoint=True)])
    cluster = flops_cluster(desc, {"d0": (10, "1 GiB"), "d1": (10, "1 GiB")})
    with pytest.raises(PlanError, match="not both"):
        simulate(mixed, desc, MemoryModel.estimated(desc), cluster, validate=False)
