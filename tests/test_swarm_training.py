"""Training across the namespace testbed gives the local trainer's weights (root only).

Each case runs the command a user would type inside the cluster,
    swarm testbed exec dev0 -- swarm train ... --strategy S --devices 4 --save X.pt
and compares X.pt with `swarm train --strategy local` of the same flags. The comparisons are in
float64, where any plan agrees with local to ~1e-12 (float32 training of these BN networks
differs by up to ~1e-2 in zero-initialised tensors even between two local runs with different
thread counts); a pure pipeline is also checked bit for bit in float32.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.conftest import ROOT, LocalRun, namespace_testbed, run_swarm

pytestmark = [pytest.mark.testbed, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the namespace testbed needs root")]

YOLO16 = ["--model", "yolov2-16", "--img-size", "64", "--batch-size", "16", "--microbatches", "4", "--steps", "2",
          "--seed", "7", "--no-eval"]
WIDE16 = ["--model", "yolov2-16", "--img-size", "64x32", "--batch-size", "8", "--microbatches", "4", "--steps", "2",
          "--seed", "7", "--no-eval"]  # a non-square input: maps 32x64 down to a 2x4 grid of cells
YOLO2 = ["--model", "yolov2", "--img-size", "64", "--batch-size", "8", "--microbatches", "4", "--steps", "2",
         "--seed", "7", "--no-eval"]

# graph networks (darknet's own cfgs): CSP blocks and two heads; residual blocks
YOLO4T = ["--model", str(ROOT / "tests" / "cfg" / "darknet" / "yolov4-tiny.cfg"), "--img-size", "64", "--batch-size", "8",
          "--microbatches", "4", "--steps", "2", "--seed", "7", "--no-eval"]
RES18 = ["--model", str(ROOT / "tests" / "cfg" / "darknet" / "resnet18.cfg"), "--img-size", "64", "--batch-size", "8",
         "--microbatches", "4", "--steps", "2", "--seed", "7", "--no-eval"]


@pytest.fixture(scope="module")
def bed():
    yield from namespace_testbed(4)


def swarm_in(device: str, *args, timeout=900):
    return run_swarm("testbed", "exec", device, "--", sys.executable, "-m", "swarm", *args, timeout=timeout,
                     env={"PYTHONPATH": str(ROOT)})


def weights(path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def worst(a: dict, b: dict) -> tuple[float, str]:
    out = (0.0, "")
    for k in a:
        if a[k].is_floating_point():
            out = max(out, (float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-30)), k))
        else:
            assert torch.equal(a[k], b[k]), k
    return out


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """The local run of (flags, dtype), started on first asking (before the testbed run it is
    compared with, which it overlaps) and shared by the tests that compare with it."""
    cache = {}

    def get(flags: tuple, dtype: str) -> LocalRun:
        key = (flags, dtype)
        if key not in cache:
            cache[key] = LocalRun(tmp_path_factory.mktemp("local") / "local.pt", *flags, "--dtype", dtype)
        return cache[key]
    return get


CASES = [
    ("yolov2-16 tiles 2x2", YOLO16, ["--strategy", "tiles", "--grid", "2x2"]),
    ("yolov2-16 dp over 4", YOLO16, ["--strategy", "dp"]),
    ("yolov2-16 dp, whole micro-batches", YOLO16, ["--strategy", "dp", "--replicas", "4"]),
    ("yolov2-16 tiles, two 1x2 replicas", YOLO16, ["--strategy", "tiles", "--grid", "1x2", "--replicas", "2"]),
    ("yolov2-16 pp over 4", YOLO16, ["--strategy", "pp", "--stages", "4"]),
    ("yolov2-16 hybrid", YOLO16, ["--strategy", "hybrid"]),
    # a non-square input where it changes what travels: halos and tiles' edges, and the
    # hybrid's hand-over from tiles to stages (every strategy at 64x32, in one process:
    # tests/test_execution.py)
    ("yolov2-16 64x32 tiles 2x2", WIDE16, ["--strategy", "tiles", "--grid", "2x2"]),
    ("yolov2-16 64x32 hybrid", WIDE16, ["--strategy", "hybrid"]),
    # yolov2's passthrough (layer 16 read by layer 25) across stages on the wire; its tiles
    # front, its dp and a tiles front before a pipeline: tests/test_execution.py, in one process
    ("yolov2 pp over 4", YOLO2, ["--strategy", "pp", "--stages", "4"]),
    # graph networks on the wire: the maps crossing each cut (skips, the first head) and their
    # gradients; every plan kind of them in one process: tests/test_graph_plans.py
    ("yolov4-tiny pp over 4", YOLO4T, ["--strategy", "pp", "--stages", "4"]),
    ("yolov4-tiny hybrid", YOLO4T, ["--strategy", "hybrid"]),
    ("resnet18 dp over 4", RES18, ["--strategy", "dp"]),
]


@pytest.mark.parametrize("name,flags,strategy", CASES, ids=[c[0] for c in CASES])
def test_plan_on_the_testbed_equals_local(bed, local_runs, tmp_path, name, flags, strategy):
    out, local = tmp_path / "swarm.pt", local_runs(tuple(flags), "float64")
    r = swarm_in("dev0", "train", *flags, *strategy, "--devices", "4", "--dtype", "float64", "--save", out)
    assert r.returncode == 0, r.stderr
    assert "plan (" in r.stderr and "stage 0" in r.stderr
    diff = worst(weights(out), local.weights())
    assert diff[0] < 1e-9, diff


def test_pipeline_is_bit_exact_in_float32(bed, local_runs, tmp_path):
    out, local = tmp_path / "pp.pt", local_runs(tuple(YOLO16), "float32")
    r = swarm_in("dev0", "train", *YOLO16, "--strategy", "pp", "--devices", "4", "--save", out)
    assert r.returncode == 0, r.stderr
    assert worst(weights(out), local.weights())[0] == 0.0
    assert "util " in r.stderr  # per-device utilisation on the progress line


def test_replicas_of_dp_groups_on_the_testbed_equal_local(bed, local_runs, tmp_path):
    """A plan file whose dp stage has two replicas of unequal groups (dev0 alone with whole
    micro-batches of 4 | dev1, dev2 and dev3 sharing theirs 2, 1, 1), taking 3 and 1 of the
    4 micro-batches, its devices mapping their largest blocks afresh (Plan.mapped, on glibc),
    its gradients summed on the lanes in an order of the plan's (Stage.sum_order, over the
    finer buckets of float64 weights): over real connections, the local trainer's weights."""
    from planner.plan import Plan, Stage
    from swarm.host import malloc

    plan = Plan("yolov2-16", 64, 16, 4, [Stage(0, 17, "dp", ["dev0", "dev1", "dev2", "dev3"],
                                                allocation={"dev0": 4, "dev1": 2, "dev2": 1, "dev3": 1},
                                                replicas=2, groups=[1, 3], shares=[3, 1],
                                                sum_order=[16, 10, 9, 6, 13])], mapped=True)
    path, out = tmp_path / "plan.json", tmp_path / "swarm.pt"
    path.write_text(plan.to_json())
    r = swarm_in("dev0", "train", *YOLO16, "--plan", path, "--devices", "4", "--dtype", "float64", "--save", out)
    assert r.returncode == 0, r.stderr
    assert "2 replicas taking 3,1 micro-batches" in r.stderr and "largest blocks mapped afresh" in r.stderr
    assert "gradients summed in the order 16,10,9,6,13" in r.stderr
    diff = worst(weights(out), local_runs(tuple(YOLO16), "float64").weights())
    assert diff[0] < 1e-9, diff
    logs = [open(d.log, errors="replace").read() for d in bed.devices]
    if malloc.find_jemalloc() is None:  # the agents run on glibc, and mapped for the job
        assert all("mapped afresh" in log for log in logs), [log[-300:] for log in logs]
    assert all("gradient sums on lanes of their own" in log for log in logs), [log[-300:] for log in logs]


def test_a_classifier_on_an_image_folder_under_dp_equals_local(bed, tmp_path):
    """resnet18 on a class-per-folder data set (`swarm data sample --task classify`), dp over
    the four devices, augmented as its cfg says (flip): the local trainer's weights; and the
    run ends with the held-out top-1 accuracy."""
    data = tmp_path / "classes"
    r = run_swarm("data", "sample", data, "--task", "classify", "--count", "60", "--width", "80", "--height", "64")
    assert r.returncode == 0, r.stderr
    flags = ["--model", "resnet18", "--data", str(data), "--img-size", "64", "--batch-size", "8", "--microbatches",
             "2", "--steps", "2", "--seed", "7", "--dtype", "float64"]
    local = LocalRun(tmp_path / "local.pt", *flags, "--no-eval")
    out = tmp_path / "swarm.pt"
    r = swarm_in("dev0", "train", *flags, "--strategy", "dp", "--devices", "4", "--save", out)
    assert r.returncode == 0, r.stderr
    assert "augmentation: flip=1" in r.stderr and "top-1 accuracy = " in r.stdout
    diff = worst(weights(out), local.weights())
    assert diff[0] < 1e-9, diff
