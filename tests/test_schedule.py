"""The 1F1B schedule (pinned output for small cases) and the Plan type."""
from __future__ import annotations

import json

import pytest

from planner.plan import Plan, PlanError, Stage
from planner.schedule import asteroid_warmup, check_warmups, draw, overlap_units, peak_resident, stage_schedule
from swarm.zoo import describe_model


def test_asteroid_example_pinned():
    p, m = 3, 6
    schedules = [stage_schedule(m, asteroid_warmup(p, s)) for s in range(p)]
    assert [asteroid_warmup(p, s) for s in range(p)] == [5, 3, 1]
    assert draw(schedules) == (
        "stage 0:  F0 F1 F2 F3 F4 B0 F5 B1 B2 B3 B4 B5\n"
        "stage 1:  F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5\n"
        "stage 2:  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5")


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("k", range(1, 10))
def test_every_microbatch_once_forward_before_backward(m, k):
    ops = stage_schedule(m, k)
    assert sorted(x for kind, x in ops if kind == "F") == list(range(m))
    assert sorted(x for kind, x in ops if kind == "B") == list(range(m))
    for x in range(m):
        assert ops.index(("F", x)) < ops.index(("B", x))
    assert peak_resident(ops) == min(k, m)


def test_gpipe_order_is_all_forwards_first():
    assert stage_schedule(3, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_growing_warmups_deadlock_and_are_refused():
    check_warmups([5, 3, 1], 4)
    check_warmups([2, 3, 1], 2)  # both clamp to 2
    with pytest.raises(ValueError, match="must not grow"):
        check_warmups([1, 3], 4)


def _plan(**kw):
    stages = kw.pop("stages", [
        Stage(0, 12, "tiles", ["a", "b"], grid=(1, 2), tile_devices=["a", "b"], syncs=[0, 4, 8]),
        Stage(12, 16, "dp", ["a", "b"], allocation={"a": 3, "b": 1}),
        Stage(16, 17, "single", ["b"])])
    return Plan(**{"model": "yolov2-16", "img_size": 64, "batch_size": 8, "microbatches": 2, "stages": stages,
                   "devices": {"a": {}, "b": {}}, "backups": {0: "b"}, **kw})


def test_plan_round_trips_through_json():
    desc = describe_model("yolov2-16", 64, classes=5)
    plan = _plan()
    plan.validate(desc)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.stages[0].backward_syncs() == [4, 8, 12]
    assert again.warmups() == [5, 3, 1]
    assert again.stage_of_layer(13) == 1 and again.stages_of_device("b") == [0, 1, 2]


@pytest.mark.parametrize("change,message", [
    (dict(stages=[Stage(0, 10, "single", ["a"]), Stage(11, 17, "single", ["b"])]), "skips layers"),
    (dict(stages=[Stage(0, 10, "single", ["a"]), Stage(9, 17, "single", ["b"])]), "repeats layers"),
    (dict(stages=[Stage(0, 16, "single", ["a"])]), "model has 17 layers"),
    (dict(stages=[Stage(0, 17, "single", ["zz"])]), "unknown device"),
    (dict(stages=[Stage(0, 17, "dp", ["a", "b"], allocation={"a": 3, "b": 2})]), "sums to 5 samples, but a micro-batch has 4"),
    (dict(stages=[Stage(0, 17, "tiles", ["a"], grid=(8, 8), tile_devices=["a"] * 64)]), "does not fit the 4x4"),
    (dict(stages=[Stage(0, 17, "tiles", ["a", "b"], grid=(2, 2), tile_devices=["a", "b"])]), "has 4 tiles"),
    (dict(stages=[Stage(0, 17, "weird", ["a"])]), "mode 'weird'"),
    (dict(stages=[Stage(0, 8, "single", ["a"], warmup=1), Stage(8, 17, "single", ["b"], warmup=2)]), "must not grow"),
    (dict(stages=[Stage(0, 17, "single", ["a", "b"], replicas=3)]), "must divide the 2 micro-batches"),
    (dict(stages=[Stage(0, 17, "single", ["a"], replicas=2)]), "2 replicas of a single stage take 2 devices"),
    (dict(stages=[Stage(0, 8, "tiles", ["a", "b"], grid=(1, 1), tile_devices=["a", "b"], replicas=2),
                  Stage(8, 17, "single", ["b"])]),
     "replicas=2 of a tiles stage only in a plan with this one stage"),
    (dict(stages=[Stage(0, 17, "dp", ["a", "b"], allocation={"a": 2, "b": 2}, replicas=2)]),
     r"replica 0's allocation \(a\) sums to 2 samples, but a micro-batch has 4"),
    (dict(stages=[Stage(0, 17, "dp", ["a", "b"], allocation={"a": 4, "b": 4}, replicas=2, groups=[2, 1])]),
     r"groups \[2, 1\] must give each of the 2 replicas at least one of the 2 devices"),
    (dict(stages=[Stage(0, 17, "dp", ["a", "b"], allocation={"a": 2, "b": 2}, groups=[1, 1])]),
     "groups are for the replicas of a dp stage"),
    (dict(stages=[Stage(0, 17, "dp", ["a", "b"], allocation={"a": 4, "b": 4}, replicas=2, shares=[2, 1])]),
     r"shares \[2, 1\] must give each of the 2 replicas at least one micro-batch, 2 in all"),
    (dict(stages=[Stage(0, 17, "single", ["a", "b"], replicas=2, deal="evenly")]), "deal is 'runs' or 'turns'"),
    (dict(stages=[Stage(0, 17, "single", ["a"], deal="turns")]), "dealt in turns only to the replicas"),
    (dict(stages=[Stage(0, 17, "tiles", ["a", "b"], grid=(1, 2), tile_devices=["a", "b"], replicas=2)]),
     "2 replicas of grid 1x2 have 4 tiles"),
    (dict(stages=[Stage(0, 17, "tiles", ["a", "b"], grid=(1, 2), tile_devices=["a", "b", "b", "a"], replicas=2)]),
     "device b has tiles in replicas 0 and 1"),
    (dict(stages=[Stage(0, 17, "tiles", ["a", "b"], grid=(1, 1), tile_devices=["a", "b"], replicas=2, together=2)]),
     "must divide each replica's 1 micro-batches"),
])
def test_plan_errors(change, message):
    desc = describe_model("yolov2-16", 64, classes=5)
    with pytest.raises(PlanError, match=message):
        _plan(**change).validate(desc)


def test_tiles_refuse_untileable_layers():
    desc = describe_model("yolov2", 64, classes=5)
    plan = _plan(model="yolov2", stages=[Stage(0, 31, "tiles", ["a"], grid=(1, 1), tile_devices=["a"])])
    with pytest.raises(PlanError, match="cannot be tiled"):
        plan.validate(desc)


@pytest.mark.parametrize("text,message", [
    ("{", "not valid JSON"),
    ("[]", "is a JSON object"),
    (json.dumps({"model": "m"}), "lacks img_size"),
    (json.dumps({"model": "m", "img_size": 1, "batch_size": 1, "microbatches": 1, "stages": [{"first": 0}]}), "stage 0"),
    (json.dumps({"model": "m", "img_size": 1, "batch_size": 1, "microbatches": 1, "stages": [], "bogus": 1}), "bogus"),
    (json.dumps({"version": 9, "model": "m"}), "version 9"),
])
def test_malformed_plan_json(text, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text)


def test_overlap_pairs_each_backward_with_the_next_forward():
    units = overlap_units(stage_schedule(6, 3))
    assert " ".join("[" + " ".join(f"{k}{m}" for k, m in u) + "]" for u in units) == \
        "[F0] [F1] [F2] [B0 F3] [B1 F4] [B2 F5] [B3] [B4] [B5]"
    assert [op for u in units for op in u] == stage_schedule(6, 3)  # the same ops, in the same order
    assert overlap_units(stage_schedule(1, 1)) == [[("F", 0)], [("B", 0)]]


def test_overlap_is_for_dp_stages_and_travels_in_the_plan_file():
    desc = describe_model("yolov2-16", 64, 5)
    n = len(desc.layers)
    dp = Stage(0, n, "dp", ["a", "b"], allocation={"a": 1, "b": 1}, overlap=True)
    plan = Plan("yolov2-16", 64, 8, 4, [dp])
    plan.validate(desc)
    again = Plan.from_json(plan.to_json())
    assert again.stages[0].overlap is True
    assert "overlap" not in Plan("yolov2-16", 64, 8, 4, [Stage(0, n, "single", ["a"])]).to_dict()["stages"][0]
    with pytest.raises(PlanError, match="only a dp stage overlaps"):
        Plan("yolov2-16", 64, 8, 4, [Stage(0, n, "single", ["a"], overlap=True)]).validate(desc)
    with pytest.raises(PlanError, match="overlap is true or false"):
        Plan.from_dict({**plan.to_dict(), "stages": [{**dp.__dict__, "overlap": "yes"}]}).validate(desc)
