"""The memory model the planner checks real devices against covers what a stage really
holds: its peak resident size, measured in a process tuned as workers are."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from planner.mapping import mapped_model
from planner.memory import RESIDENT_SLACK, SHARE_GROWTH, STAGE_SCRATCH_BYTES, JOB_BYTES, MemoryModel, streamed
from swarm.zoo import describe_model
from tests.conftest import jemalloc_library

ROOT = Path(__file__).resolve().parent.parent

# K micro-batches of one sample forward through layers [first, last), then their backwards,
# as a pipeline stage runs them; prints the peak resident bytes above the settled start
STAGE = textwrap.dedent("""
    import json, sys
    import torch
    from swarm.host import malloc
    from swarm.profiling.profiler import _PeakRSS, settled_rss
    from swarm.zoo import build_model
    malloc.tune()
    torch.set_num_threads(1)
    first, last, k, size = map(int, sys.argv[1:5])
    net, desc, _ = build_model("yolov2-16", size, classes=5, seed=1)
    net.train()
    if sys.argv[4:] == ["remade"]:
        from planner.memory import recomputable
        net.recompute = recomputable(desc)
    layers = net.layers[first:last]
    def forward(x):
        for layer in layers:
            x = layer(x)
        return x
    x = torch.rand(1, *desc.layers[first].in_shape)
    forward(x).sum().backward()  # kernels initialised, weights' gradients allocated
    base = settled_rss()
    with _PeakRSS() as rss:
        outs = [forward(x.clone().requires_grad_(first > 0)) for _ in range(k)]
        for y in outs:
            y.backward(torch.randn_like(y))
        del outs, y
    print(json.dumps({"peak": rss.peak - base}))
""")


def swarm_glibc_environment() -> dict[str, str]:
    """This environment, with glibc's settings as the `swarm` command starts itself again with
    them (swarm.host.malloc: no tcache) and nobody else's."""
    import os

    from swarm.host import malloc

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES", malloc.PRELOADED)}
    return dict(env, GLIBC_TUNABLES=malloc.GLIBC_TUNABLES, **{malloc.PRELOADED: "glibc"})


@pytest.mark.parametrize("first,last,k", [(0, 4, 1), (0, 4, 4), (4, 8, 3), (12, 17, 1)])
def test_stage_peak_is_within_the_device_memory_model(first, last, k):
    size = 320
    run = subprocess.run([sys.executable, "-c", STAGE, str(first), str(last), str(k), str(size)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=swarm_glibc_environment())
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout.strip().splitlines()[-1])["peak"]
    desc = describe_model("yolov2-16", size, 5)
    model = MemoryModel.for_devices(desc)
    # the weights and their gradients were resident before the measurement began
    stage = model.stage(first, last, 1, k) - model.weights(first, last)
    predicted = stage + STAGE_SCRATCH_BYTES
    assert peak <= predicted, f"measured {peak / 2**20:.0f} MiB, predicted {predicted / 2**20:.0f} MiB"
    # and the margin is a margin, not a different model
    assert predicted <= 1.8 * peak
    bare = MemoryModel(desc, model.act_bytes, reuse=False)  # glibc's model without its slack
    assert bare.stage(first, last, 1, k) - bare.weights(first, last) == pytest.approx(stage / RESIDENT_SLACK)


def test_largest_share_is_the_most_samples_whose_stage_fits():
    desc = describe_model("yolov2-16", 416, 5)
    model = MemoryModel.for_devices(desc)
    n = len(desc.layers)
    for first, last in [(0, n), (0, 6), (6, n)]:
        for warmup in (1, 3):
            for mib in (0, 50, 300, 426, 618, 1450, 4000):
                budget = mib * 2**20
                b = model.max_batch(first, last, warmup, budget)
                room = model.budget(first, last, budget)
                fits = [k for k in range(0, 256) if model.stage(first, last, k, warmup) <= room]
                assert b == (max(fits) if model.weights(first, last) <= room else 0), (first, last, warmup, mib)


def test_a_share_is_held_in_proportion_to_its_samples_and_the_whole_model_keeps_the_reserve():
    """On glibc without its small-chunk caches (swarm.host.malloc) a share's peak is linear in
    its samples (planner/memory.py, SHARE_GROWTH); with a growth, a larger share holds more."""
    desc = describe_model("yolov2-16", 416, 5)
    model, n = MemoryModel.for_devices(desc), len(desc.layers)
    per = model.activations(0, n, 1) + model.transient(0, n, 1)
    assert model.stage(0, n, 2, 1) - model.weights(0, n) == pytest.approx(2 * per)
    assert model.stage(0, n, 4, 1) - model.weights(0, n) == pytest.approx(4 * per * (1 + 2 * SHARE_GROWTH))
    growing = MemoryModel(desc, model.act_bytes, slack=model.slack, growth=0.15, reuse=False)
    assert growing.stage(0, n, 4, 1) - growing.weights(0, n) == pytest.approx(4 * per * 1.3)
    assert model.budget(0, n, 1e9) == 1e9 + JOB_BYTES and model.budget(0, n - 1, 1e9) == 1e9
    # a 1 GiB device (426 MiB once its runtime and the job's reserve are off) holds 2
    # samples of the whole model, as measured on the mixed testbed, and a 2 GiB one 7 (in
    # one process 7 samples peaked 1404-1427 MiB above the start, 2026-11-30: about 1.7 GiB
    # with the runtime)
    assert model.max_batch(0, n, 1, 426 * 2**20) == 2 and model.max_batch(0, n, 1, 1450 * 2**20) == 7
    assert MemoryModel.estimated(desc).share_factor(8) == 1.0  # the papers' equation has no slack


def test_the_backward_buffers_take_the_room_the_later_layers_freed_where_the_allocator_reuses_it():
    """transient against the backward walked layer by layer: while layer k back-propagates,
    the micro-batch holds what layers first..k saved and k's buffers; the layers after k
    have freed theirs. Without reuse the buffers come on top of everything saved."""
    desc = describe_model("yolov2-16", 416, 5)
    n = len(desc.layers)
    for reuse in (True, False):
        model = MemoryModel(desc, MemoryModel.estimated(desc).act_bytes, reuse=reuse)
        for first, last in [(0, n), (0, 4), (3, 9), (8, n), (5, 6)]:
            saved = model.act_bytes[first:last].sum()
            if reuse:
                walk = max(model.act_bytes[first:k + 1].sum() + model.grad_bytes[k] for k in range(first, last))
                expected = max(0.0, walk - saved)
            else:
                expected = model.grad_bytes[first:last].max()
            assert model.transient(first, last, 3) == pytest.approx(3 * expected), (reuse, first, last)
            assert model.transient(first, last, 3) <= model.buffers(first, last, 3)
    # yolov2-16's first layer holds the largest buffers, once the rest have freed 81 MiB a sample
    assert MemoryModel.estimated(desc).transient(0, n, 1) < 0.1 * MemoryModel.estimated(desc).buffers(0, n, 1)


def test_a_1_gib_device_on_jemalloc_holds_a_four_sample_share_of_the_whole_model():
    """On the testbed (1 GiB, yolov2-16 at 416, jemalloc) a dp device computing micro-batches
    of 4 samples peaked at 859-868 MiB with its runtime: the plan may give it 4 samples, as
    it gives a glibc device 2 (1 GiB less a 340 MiB runtime and the job's reserve: 430 MiB)."""
    desc = describe_model("yolov2-16", 416, 5)
    n, budget = len(desc.layers), 430 * 2**20
    assert MemoryModel.for_devices(desc, allocator="jemalloc").max_batch(0, n, 1, budget) == 4
    assert MemoryModel.for_devices(desc, allocator="glibc").max_batch(0, n, 1, budget) == 2
    # where a plan maps the largest blocks afresh (planner.mapping), glibc holds as much as
    # jemalloc; a profile made while swarm ran glibc's heap in huge pages ("glibc-thp") is read
    # as glibc's
    glibc, glibc_thp = (MemoryModel.for_devices(desc, allocator=a) for a in ("glibc", "glibc-thp"))
    assert mapped_model(glibc).max_batch(0, n, 1, budget) >= 4
    assert glibc_thp.max_batch(0, n, 1, budget) == 2 and mapped_model(glibc_thp).max_batch(0, n, 1, budget) >= 4


# a dp device's share: b samples of a micro-batch through the whole model, three micro-batches
# one after another (the heap's holes grow over the first few); the peak above the settled start
SHARE = textwrap.dedent("""
    import json, sys
    import torch
    from swarm.host import malloc
    from swarm.profiling.profiler import _PeakRSS, settled_rss
    from swarm.zoo import build_model
    malloc.tune()
    mapped = malloc.map_large(sys.argv[3] == "map")
    torch.set_num_threads(1)
    b, size = map(int, sys.argv[1:3])
    net, desc, _ = build_model("yolov2-16", size, classes=5, seed=1)
    net.train()
    if sys.argv[4:] == ["remade"]:
        from planner.memory import recomputable
        net.recompute = recomputable(desc)
    net.checkpoint = sys.argv[4:] == ["checkpointed"]
    net(torch.rand(1, *desc.layers[0].in_shape)).sum().backward()
    base = settled_rss()
    with _PeakRSS() as rss:
        for _ in range(3):
            net(torch.rand(b, *desc.layers[0].in_shape)).float().pow(2).mean().backward()
    print(json.dumps({"peak": rss.peak - base, "allocator": malloc.allocator() + ("+mapped" if mapped else "")}))
""")


def share_peak(b: int, size: int, env_extra: dict, how: str = "heap", remade: bool = False,
               checkpointed: bool = False) -> dict:
    import os

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "SWARM_PRELOADED")}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    form = ["remade"] if remade else ["checkpointed"] if checkpointed else []
    run = subprocess.run([sys.executable, "-c", SHARE, str(b), str(size), how, *form], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


# how far above a share's peak the model of each allocator may be (see the test below)
MARGIN = {"glibc": 1.6, "glibc+mapped": 1.3, "jemalloc": 1.2}


@pytest.mark.parametrize("allocator", ["glibc", "glibc+mapped", "jemalloc"])
def test_a_whole_model_share_fits_the_model_of_its_allocator(allocator):
    """Each allocator a `swarm` command may run a training on: glibc with every block in its
    heap (where jemalloc is neither installed nor fetched), and on it a plan that maps its largest
    blocks afresh (planner.mapping), and jemalloc (installed, or fetched by swarm.host.malloc)."""
    env = allocator_environment(allocator.split("+")[0])  # as the swarm command runs on it
    how = "map" if allocator.endswith("+mapped") else "heap"
    size = 320
    desc = describe_model("yolov2-16", size, 5)
    model, n = MemoryModel.for_devices(desc, allocator=allocator.split("+")[0]), len(desc.layers)
    if how == "map":
        model = mapped_model(model)
    for b in (2, 4):
        # Every run's peak is under the model's: a hard bound. (With glibc's small-chunk caches
        # on, the peak of one share varied from run to run, 269-408 MiB at 2 samples over 19
        # runs, and only a median was under the model; without them, as swarm runs glibc
        # (swarm.host.malloc), 228-245 over 6 runs, and 4 samples 427-521: bench/RESULTS.md.)
        # (one run a size, a second where the first came out low: a run is a fresh process, and CI
        # measures again every time; the bound holds for every run)
        runs = [share_peak(b, size, env, how)]
        assert {m["allocator"] for m in runs} == {allocator}
        predicted = model.stage(0, n, b, 1) - model.weights(0, n) + STAGE_SCRATCH_BYTES
        if predicted > MARGIN[allocator] * runs[-1]["peak"]:  # a low run (199 MiB once, 247-252 usually): again
            runs.append(share_peak(b, size, env, how))
        peaks = [m["peak"] / 2**20 for m in runs]
        assert all(m["peak"] <= predicted for m in runs), \
            f"{b} samples: measured {peaks} MiB, predicted {predicted / 2**20:.0f}"
        # and the margin is a margin, not a different model: glibc's slack (1.15, fitted again
        # once its small-chunk caches were off: planner/memory.py) is within 1.6x a 2-sample
        # share, where the fixed stage scratch is a large part (213-249 MiB against 324), and
        # within 1.25x at 4 samples (479-520 against 583), in its heap in huge pages or not;
        # jemalloc's within 1.2x (at 320, 2 and 4 samples 231 and 404 MiB against 254 and 444,
        # the same to the MiB in every run: 1.10x; at 416, 4 samples 611 against 707, 1.16x:
        # its slack is set from a testbed device's job, 2-4% under the model); a mapped
        # heap's, fitted (planner.mapping.MAPPED_SLACK), within 30% (at 320 px the stage
        # scratch, a fixed 64 MiB, is a larger part: at 416, 4 samples 520-526 MiB against 578,
        # 2 samples 275-281 against 321; at 320, 2 samples 172-203 MiB against 216 over nine
        # runs, the least beside the suite's other processes: the kernel's VmHWM reads the same,
        # so the sampled peak misses nothing; what varies is the run's own resident peak)
        assert predicted <= MARGIN[allocator] * max(m["peak"] for m in runs), \
            f"{b} samples: measured {peaks} MiB, predicted {predicted / 2**20:.0f}"


@pytest.mark.parametrize("allocator", ["glibc", "jemalloc"])
def test_a_remade_share_that_streams_fits_the_model_of_its_allocator(allocator):
    """A whole micro-batch of yolov2-16 at 416 that remakes BatchNorm, whose two largest layers
    back-propagate a few channels at a time (swarm.zoo.recompute): every run's peak is under the
    model's, and the model within 1.4x of it on glibc, 1.2x on jemalloc (405 MiB in every run
    against 467). (On glibc 441-471 MiB in three runs against 589:
    the model charges the largest layer's backward buffers on top of every layer's saved maps,
    where by then the later layers' are freed and some of their room reused.)"""
    env = allocator_environment(allocator)
    desc = describe_model("yolov2-16", 416, 5)
    model, n = MemoryModel.for_devices(desc, allocator=allocator).recomputing(), len(desc.layers)
    assert streamed(desc, model.remade) == {0, 2}
    predicted = model.stage(0, n, 4, 1) - model.weights(0, n) + STAGE_SCRATCH_BYTES
    assert_share_fits(predicted, 4, 416, env, allocator, within={"glibc": 1.4, "jemalloc": 1.2}[allocator],
                      remade=True)


def assert_share_fits(predicted: float, b: int, size: int, env: dict, allocator: str, within: float = 1.4,
                      **form) -> None:
    """Every run's peak of a whole-model share (share_peak, of `form`) is under `predicted`, and
    `predicted` within `within` times the most measured (a second run where the first came out low)."""
    runs = [share_peak(b, size, env, **form)]
    if predicted > within * runs[-1]["peak"]:  # a low run: again
        runs.append(share_peak(b, size, env, **form))
    peaks = [m["peak"] / 2**20 for m in runs]
    assert {m["allocator"] for m in runs} == {allocator}
    assert all(m["peak"] <= predicted for m in runs), f"measured {peaks} MiB, predicted {predicted / 2**20:.0f}"
    assert predicted <= within * max(m["peak"] for m in runs), f"measured {peaks} MiB, predicted {predicted / 2**20:.0f}"


def allocator_environment(allocator: str) -> dict[str, str]:
    """What a `swarm` command sets to run a training on `allocator` (glibc as swarm.host.malloc
    tunes it, or jemalloc preloaded: conftest.jemalloc_library; skips the test where there is none)."""
    from swarm.host import malloc

    if allocator == "jemalloc":
        library = jemalloc_library()
        if library is None:
            pytest.skip("jemalloc is not installed here")
        return {"LD_PRELOAD": library, "MALLOC_CONF": malloc.JEMALLOC_CONF}
    return {"GLIBC_TUNABLES": malloc.GLIBC_TUNABLES, malloc.PRELOADED: "glibc"}


@pytest.mark.parametrize("allocator", ["glibc", "jemalloc"])
def test_a_checkpointed_share_fits_the_model_of_its_allocator(allocator):
    """A whole micro-batch of yolov2-16 at 320 that runs in checkpointed segments
    (planner.checkpoint): every run's peak is under the model's, and the model within 1.2x of
    it on jemalloc, 1.6x on glibc's heap. (4 samples, three micro-batches, 2026-12-04: jemalloc
    365-366 MiB over four layouts of the process against 394; glibc 309-400 over eight against
    440, the same passes peaking up to 29% apart with nothing but the layout changed. Where the
    allocator reuses freed room (jemalloc) the model frees the later segments' kept inputs once
    they are back-propagated; on glibc's heap it charges them all the way: bench/RESULTS.md,
    2026-12-04 15:53-16:30 UTC.)"""
    from planner.checkpoint import checkpointing_model

    env = allocator_environment(allocator)
    desc = describe_model("yolov2-16", 320, 5)
    model, n = checkpointing_model(MemoryModel.for_devices(desc, allocator=allocator)), len(desc.layers)
    predicted = model.stage(0, n, 4, 1) - model.weights(0, n) + STAGE_SCRATCH_BYTES
    assert_share_fits(predicted, 4, 320, env, allocator, within={"glibc": 1.6, "jemalloc": 1.2}[allocator],
                      checkpointed=True)
