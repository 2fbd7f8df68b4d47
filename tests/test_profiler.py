"""The profiler: per-layer times at several batch sizes, saved bytes, step peaks, the cache."""
from __future__ import annotations

import json

import numpy as np
import pytest

from planner.memory import MemoryModel
from planner.profile import DeviceProfile
from swarm.profiling.profiler import device_facts, load_or_profile, profile_model, read_profile
from swarm.zoo import describe_model


@pytest.fixture(scope="module")
def profile():
    return profile_model("yolov2-16", 32, batch_sizes=(1, 2), repeats=1, threads=1)


def test_profile_has_every_layer_at_every_batch_size(profile):
    desc = describe_model("yolov2-16", 32, profile.classes)
    costs = profile.costs
    assert costs.batch_sizes == (1, 2) and costs.num_layers == len(desc.layers)
    assert (costs.fwd > 0).all() and (costs.bwd > 0).all()
    assert (costs.update[[i for i, layer in enumerate(desc.layers) if layer.params]] > 0).all()
    assert costs.loss_fwd[0] > 0 and costs.loss_bwd[0] > 0
    assert set(profile.step_time) == {1, 2} and all(t > 0 for t in profile.step_time.values())
    assert set(profile.peak_bytes) == {1, 2} and profile.runtime_bytes > 0
    profile.check_matches(desc)


def test_saved_bytes_are_what_autograd_keeps(profile):
    """The measured bytes per layer equal the shape-based estimate the planner uses without a profile."""
    desc = describe_model("yolov2-16", 32, profile.classes)
    estimate = MemoryModel.estimated(desc).act_bytes
    assert np.allclose(profile.act_bytes, estimate, rtol=0.05, atol=16384)  # (tiny maps: small extras)
    assert sum(profile.act_bytes) == pytest.approx(sum(estimate), rel=0.05)


def test_profiling_leaves_no_graph_alive():
    """A profile runs in the agent that trains next: what it measured must be freed. (Counting
    saved tensors with a hook that keeps the tensor itself kept every layer's activations
    alive, through the in-place activations that save their own output.)"""
    import gc

    import torch

    def graphs() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None)

    before = graphs()
    profile_model("yolov2-16", 32, batch_sizes=(1,), repeats=1, threads=1)
    assert graphs() == before


def test_profile_round_trips_and_is_cached(tmp_path):
    p1, cached1, path = load_or_profile("lenet5", None, None, tmp_path, batch_sizes=(1, 2), repeats=1, threads=1)
    p2, cached2, path2 = load_or_profile("lenet5", None, None, tmp_path, batch_sizes=(1, 2), repeats=1, threads=1)
    assert (cached1, cached2) == (False, True) and path == path2
    assert path.parent.name == device_facts(1)["fingerprint"]
    assert read_profile(path).to_dict() == p1.to_dict() == p2.to_dict()
    again = DeviceProfile.from_dict(json.loads(path.read_text()))
    assert again.costs.fwd_range(0, 7, 2) == pytest.approx(p1.costs.fwd_range(0, 7, 2))
    p3, cached3, _ = load_or_profile("lenet5", None, None, tmp_path, batch_sizes=(1,), repeats=1, threads=1,
                                     refresh=True)
    assert not cached3 and p3.costs.batch_sizes == (1,)


def test_a_profile_called_off_stops_at_its_next_timing():
    """A profile whose job was released gives up at the next timing it would start, rather
    than measuring on for minutes on a small device: here it is called off while it times
    batch 2 and says nothing of batch 4."""
    import threading

    from swarm.profiling.clocks import ProfileStopped

    stop, said = threading.Event(), []

    def log(line):
        said.append(line)
        if line.startswith("batch 2:"):
            stop.set()

    with pytest.raises(ProfileStopped):
        profile_model("lenet5", None, batch_sizes=(1, 2, 4), repeats=2, threads=1, log=log, stop=stop)
    assert any(line.startswith("batch 1:") for line in said)
    assert not any(line.startswith("batch 4:") for line in said), said
    # not called off: the same profile measures every size
    said.clear()
    done = profile_model("lenet5", None, batch_sizes=(1, 2, 4), repeats=2, threads=1, log=said.append,
                         stop=threading.Event())
    assert done.costs.batch_sizes == (1, 2, 4)


def test_batch_sizes_that_would_outgrow_the_memory_are_not_run(monkeypatch):
    """On a device whose memory a large batch would exceed, the profile stops at the sizes
    that fit (the cost table extends past them); when not even the smallest fits, a clear
    error rather than an agent killed by the kernel."""
    import swarm.profiling.memory_guard as memory_guard
    from swarm.errors import SwarmError

    rss = memory_guard.settled_rss()
    per_sample = 1.4 * memory_guard.MemoryGuard(describe_model("lenet5"), "sgd", limit=1).estimate
    margin, share = memory_guard.MemoryGuard.MARGIN, memory_guard.MemoryGuard.SHARE
    # room for one sample's estimated peak, and well short of 4096 samples'
    monkeypatch.setattr(memory_guard, "spare_memory", lambda: int((rss + 2 * margin * per_sample + 2**26) / share))
    said = []
    profile = profile_model("lenet5", None, batch_sizes=(1, 4096), repeats=1, threads=1, log=said.append)
    assert profile.costs.batch_sizes == (1,) and set(profile.step_time) == {1} and set(profile.peak_bytes) == {1}
    assert any(m.startswith("batch 4096: skipped, it would need about") for m in said)
    assert profile.costs.fwd_range(0, 7, 8) == pytest.approx(8 * profile.costs.fwd_range(0, 7, 1))

    monkeypatch.setattr(memory_guard, "spare_memory", lambda: rss)
    with pytest.raises(SwarmError, match="cannot profile the model: layer 0 alone on 1 sample would need about"):
        profile_model("lenet5", None, batch_sizes=(1, 2), repeats=1, threads=1)


def test_the_first_step_counts_the_gradients_and_optimizer_state_it_allocates():
    """Before anything is measured the guard adds what the first step allocates beyond the
    model: gradients and momentum, two floats a parameter under SGD. The full yolov2 at 416
    (50.6 M parameters) on a 1 GiB device: an agent holding the model is refused, with the
    message the coordinator recognises, where without them it would have run and been killed
    for memory. Once a step is measured its peak includes them."""
    from swarm.profiling.memory_guard import CANNOT_PROFILE, MemoryGuard

    desc = describe_model("yolov2", 416)
    guard = MemoryGuard(desc, "sgd", limit=2**30)
    params = sum(d.param_bytes for d in desc.layers)
    assert guard.state == 2 * params > 400e6
    guard.base = 270 * 2**20 + params  # an agent at rest, and the model it built
    assert guard.need(1, {}) == pytest.approx(guard.base + guard.state + guard.MARGIN * 1.4 * guard.estimate)
    assert not guard(1, {})
    assert guard.need(1, {}) - guard.state <= guard.SHARE * guard.limit  # what the guard used to find
    assert CANNOT_PROFILE in guard.too_small(1)
    assert guard.need(2, {1: 300e6}) == pytest.approx(guard.base + guard.MARGIN * 2 * 300e6)



def test_a_model_too_big_to_step_whole_is_measured_in_pieces(monkeypatch):
    """Where the model, its gradients and optimizer state and a sample's activations do not
    fit together (the full yolov2 on a 1 GiB Pi), each layer is measured in a pass over a
    piece of the model that fits, not left to estimates: every layer's times, the same saved
    bytes as measuring the model whole (they are autograd's, whatever runs around them), and
    times of the same order."""
    import re

    import swarm.profiling.memory_guard as memory_guard

    whole = profile_model("yolov2", 64, batch_sizes=(1,), repeats=1, threads=1, clock="cpu")
    desc = describe_model("yolov2", 64, whole.classes)
    state = memory_guard.MemoryGuard(desc, "sgd", limit=1).state
    # room for the model's gradients but not their momentum as well: not a whole step, nor one
    # piece of every layer (their gradients and activations)
    monkeypatch.setattr(memory_guard, "spare_memory",
                        lambda: int((memory_guard.settled_rss() + state / 2) / memory_guard.MemoryGuard.SHARE))
    said = []
    pieces = profile_model("yolov2", 64, batch_sizes=(1,), repeats=1, threads=1, clock="cpu", log=said.append)
    cut = next(m for m in said if m.startswith("batch 1: layers in"))
    assert int(re.match(r"batch 1: layers in (\d+) pieces", cut).group(1)) >= 2, said
    assert "layers measured in" in pieces.costs.source and "pieces" in pieces.costs.source
    costs = pieces.costs
    assert costs.batch_sizes == (1,) and costs.num_layers == len(desc.layers)
    assert (costs.fwd > 0).all() and (costs.bwd[[i for i, d in enumerate(desc.layers) if d.params]] > 0).all()
    assert (costs.update[[i for i, d in enumerate(desc.layers) if d.params]] > 0).all()
    assert costs.loss_fwd[0] > 0 and costs.loss_bwd[0] > 0
    assert pieces.act_bytes == whole.act_bytes
    assert pieces.step_time == {} and pieces.peak_bytes == {} and pieces.runtime_bytes > 0
    ratio = costs.range_time(0, len(desc.layers), 1) / whole.costs.range_time(0, len(desc.layers), 1)
    assert 1 / 3 < ratio < 3
    pieces.check_matches(desc)


def test_pieces_are_the_longest_that_fit_and_cover_the_model():
    """The full yolov2 at 416 on a 1 GiB device, the model built (an agent at rest and its
    weights): contiguous pieces from the first layer, each within the share of memory and
    each as long as fits; a layer that does not fit alone is named."""
    from swarm.profiling.memory_guard import CANNOT_PROFILE, MemoryGuard

    desc = describe_model("yolov2", 416)
    guard = MemoryGuard(desc, "sgd", limit=2**30)
    guard.base = 270 * 2**20 + sum(d.param_bytes for d in desc.layers)
    room = guard.SHARE * guard.limit
    assert not guard(1, {})
    cuts = guard.pieces(1)
    assert cuts[0][0] == 0 and cuts[-1][1] == len(desc.layers) and len(cuts) > 1
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert all(guard.piece_need(1, a, e) <= room for a, e in cuts)
    assert all(guard.piece_need(1, a, e + 1) > room for a, e in cuts[:-1])
    guard.measured_piece(1, *cuts[0], guard.piece_need(1, *cuts[0]) + 64 * 2**20)  # it held more than its estimate
    assert guard.piece_extra > 0 and guard.pieces(1) != cuts
    guard.base = room - 2**20
    assert guard.pieces(1) is None
    layer = guard.first_too_big(1)
    assert f"{CANNOT_PROFILE}: layer {layer} alone on 1 sample would need about" in guard.too_small(1, layer)


def test_broken_cache_entry_is_measured_again(tmp_path):
    _, _, path = load_or_profile("lenet5", None, None, tmp_path, batch_sizes=(1,), repeats=1, threads=1)
    path.write_text("{not json")
    profile, cached, _ = load_or_profile("lenet5", None, None, tmp_path, batch_sizes=(1,), repeats=1, threads=1)
    assert not cached and profile.costs.num_layers == 7


def test_quota_clock_counts_cpu_time_spread_over_the_quota(monkeypatch):
    """Under a quota of q cores a layer that ran at full speed still costs its CPU time / q;
    one that waited out the quota costs its wall time."""
    import swarm.profiling.clocks as clocks

    wall, cpu = [0.0], [0.0]
    monkeypatch.setattr(clocks.time, "perf_counter", lambda: wall[0])
    monkeypatch.setattr(clocks.time, "process_time", lambda: cpu[0])
    clock = clocks.QuotaClock(0.25)
    t0 = clock()
    wall[0] += 0.010  # ran unthrottled
    cpu[0] += 0.010
    t1 = clock()
    assert t1 - t0 == pytest.approx(0.040)
    wall[0] += 0.100  # throttled, and then some
    cpu[0] += 0.010
    assert clock() - t1 == pytest.approx(0.100)
    layers = clocks.QuotaCPUClock(0.25)  # for short timings: the CPU time alone, spread over the quota
    t2 = layers()
    wall[0] += 0.100
    cpu[0] += 0.010
    assert layers() - t2 == pytest.approx(0.040)


def test_layer_times_are_fitted_to_whole_steps():
    """Each batch size's layer and loss times are scaled so that, with the updates, they add
    up to the whole step measured at that size; a fit out of bounds leaves them alone."""
    from swarm.profiling.layer_times import fit_to_steps

    fwd, bwd = [[0.1, 0.2], [0.2, 0.4]], [[0.2, 0.4], [0.4, 0.8]]
    loss_f, loss_b = [0.05, 0.1], [0.05, 0.1]
    factors = fit_to_steps(fwd, bwd, loss_f, loss_b, 0.1, [0.1 + 0.8, 10.0])
    assert factors == pytest.approx([0.8, 1.0])
    assert sum(fwd[0]) + sum(bwd[0]) + loss_f[0] + loss_b[0] + 0.1 == pytest.approx(0.9)
    assert fwd[0] == pytest.approx([0.08, 0.16]) and loss_b[0] == pytest.approx(0.04)
    assert fwd[1] == [0.2, 0.4] and loss_f[1] == 0.1  # x5.3: the measurements disagree


def test_profile_says_its_layers_are_fitted(profile):
    assert "layers fitted to whole steps" in profile.costs.source


def test_profile_measures_the_tiles_executors_overhead(profile):
    assert 0.5 < profile.costs.tiles_overhead < 5
    again = DeviceProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.costs.tiles_overhead == profile.costs.tiles_overhead
    assert again.costs.scaled(2.0).tiles_overhead == profile.costs.tiles_overhead


def test_a_network_whose_maps_pass_over_layers_is_profiled():
    """yolov2's passthrough: layer 16's output crosses layers 17-23 to the route at 24; timing
    the layers one by one hands it along instead of losing it."""
    desc = describe_model("yolov2", 64)
    assert any(16 in desc.live_after(i) for i in range(17, 24))
    profile = profile_model("yolov2", 64, batch_sizes=(1,), repeats=1, threads=1)
    assert profile.costs.num_layers == len(desc.layers) and (profile.costs.fwd > 0).all()
    profile.check_matches(desc)


def test_the_device_generic_path_with_an_explicit_device_gives_the_same_profile():
    """What a CUDA profile runs (a torch.device given, the layers on it, timed by its
    Stopwatch) run on the host: every figure of the default profile, and no accelerator
    entry, since nothing crosses between host and accelerator."""
    import torch

    from swarm.profiling.clocks import Stopwatch

    plain = profile_model("lenet5", None, batch_sizes=(1, 2), repeats=1, threads=1)
    given = profile_model("lenet5", None, batch_sizes=(1, 2), repeats=1, threads=1, device=torch.device("cpu"))
    a, b = plain.to_dict(), given.to_dict()
    assert set(a) == set(b) and set(a["costs"]) == set(b["costs"]) and a["device"] == b["device"]
    assert "accelerator" not in b["device"] and given.costs.batch_sizes == (1, 2)
    assert (given.costs.fwd > 0).all() and (given.costs.bwd > 0).all()
    assert np.array(b["costs"]["fwd"]).shape == np.array(a["costs"]["fwd"]).shape
    watch = Stopwatch(torch.device("cpu"), iter([1.0, 3.5]).__next__)
    start, end = watch.mark(), watch.mark()
    watch.settle()
    assert watch.seconds(start, end) == 2.5


def test_copies_are_timed_there_and_back_through_the_host_path():
    """The copy rate a profile on an accelerator gives the planner, measured by the same code
    on the host (there a copy in is a clone, and bringing it back is free)."""
    import torch

    from swarm.profiling.accelerator import copy_gbps
    from swarm.profiling.clocks import Budget

    rate = copy_gbps([torch.ones(4, 16, 32, 32), torch.ones(4, 32, 16, 16)], torch.device("cpu"), Budget(3))
    assert 0 < rate < float("inf")


def test_a_profile_job_measures_on_what_the_agent_offers_where_torch_can(monkeypatch):
    import torch

    from swarm.profiling.accelerator import usable_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [usable_accelerator(a) for a in ("cuda", "cpu", None)] == ["cpu"] * 3  # a CPU build of torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [usable_accelerator(a) for a in ("cuda", "cpu", None)] == ["cuda", "cpu", "cpu"]


def test_the_table_says_which_accelerator_and_its_copies_and_memory(profile):
    from swarm.commands.profile_cmd import profile_table

    on_gpu = DeviceProfile.from_dict(profile.to_dict())
    on_gpu.device["accelerator"] = {"kind": "cuda", "note": "a discrete GPU", "shared_memory": False,
                                    "copy_gbps": 11.5, "memory": 7 * 2**30}
    text = profile_table(on_gpu)
    assert "a discrete GPU (cuda; copies to and from the host at 11.5 GB/s; 7 GiB free on it" in text
    assert "peak memory above runtime (on the GPU)" in text
    on_gpu.device["accelerator"].update(shared_memory=True, note="a Jetson's GPU")
    assert "memory shared with the CPU" in profile_table(on_gpu)
    assert "threads" in profile_table(profile).splitlines()[0]


def test_a_batch_size_the_gpus_memory_cannot_hold_is_skipped(monkeypatch):
    """A discrete GPU runs out of its own memory (torch raises; the host's guard cannot see
    it coming): the profile keeps the sizes measured before it."""
    import torch

    import swarm.profiling.measure as measure

    class FullAtTheSecondSize(measure.PeakRSS):
        entered = 0

        def __enter__(self):
            FullAtTheSecondSize.entered += 1
            if FullAtTheSecondSize.entered == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            return super().__enter__()

    monkeypatch.setattr(measure, "PeakRSS", FullAtTheSecondSize)
    lines = []
    profile = profile_model("lenet5", None, batch_sizes=(1, 2, 4), repeats=1, threads=1, log=lines.append)
    assert profile.costs.batch_sizes == (1,) and set(profile.step_time) == {1}
    assert "batch 2: skipped, it does not fit in the GPU's memory" in lines


def test_a_network_with_batchnorm_over_a_1x1_map_is_measured_on_two_samples_or_more():
    """yolov2-tiny at 32: layers 10, 12 and 13 normalise 1x1 maps, which torch cannot train on
    one sample (one value per channel). Where the profile would have measured one sample it
    measures two, and gives one sample half their time; the other sizes are kept."""
    said = []
    profile = profile_model("yolov2-tiny", 32, batch_sizes=(1, 4), repeats=1, threads=1, log=said.append)
    desc = describe_model("yolov2-tiny", 32, profile.classes)
    costs, n = profile.costs, len(desc.layers)
    assert costs.batch_sizes == (2, 4) and set(profile.step_time) == {2, 4} and set(profile.peak_bytes) == {2, 4}
    assert np.isfinite(costs.fwd).all() and (costs.fwd > 0).all()
    assert np.isfinite(costs.bwd).all() and (costs.bwd[[i for i, d in enumerate(desc.layers) if d.params]] > 0).all()
    assert costs.loss_fwd[0] > 0 and costs.loss_bwd[0] > 0
    one = costs.range_time(0, n, 1, with_loss=True)
    assert np.isfinite(one) and one > 0 and one == pytest.approx(costs.range_time(0, n, 2, with_loss=True) / 2)
    assert np.isfinite(profile.act_bytes).all() and sum(profile.act_bytes) > 0
    assert all(np.isfinite(t) and t > 0 for t in profile.step_time.values()) and profile.runtime_bytes > 0
    assert any("layer 10's BatchNorm sees a 1x1 map" in line for line in said), said
    profile.check_matches(desc)


def test_a_graph_networks_tileable_front_is_timed_as_the_network_runs_it():
    """yolov4-tiny's tileable front holds a CSP block (a route taking half a map's channels, two
    concatenations): the untiled reference runs it through the network's own graph."""
    from pathlib import Path

    from tiles.layout import tileable_prefix

    path = str(Path(__file__).resolve().parent / "cfg" / "darknet" / "yolov4-tiny.cfg")
    desc = describe_model(path, 64)
    assert any(layer.kind == "route" for layer in desc.layers[:tileable_prefix(desc)])
    profile = profile_model(path, 64, batch_sizes=(1, 2), repeats=1, threads=1)
    assert 0.2 < profile.costs.tiles_overhead < 10
