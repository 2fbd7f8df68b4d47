"""This device's profile as the rest of swarm asks for it: cached, or measured; the job kind "profile".

`load_or_profile` reads the profile from the cache in the state directory, else measures and
caches it; `run_profile_job` is the agents' job kind "profile", and `profile_devices` runs it
on every agent. The profile is plain data:

    profile, cached, path = load_or_profile("yolov2-16", 128, state_dir=default_state_dir())
    profile.costs.fwd_range(0, 17, 4)    # planner.profile.DeviceProfile

How it is measured lives beside this module, a concept each: `profile_model` and its whole
steps in measure.py; timing layers, passes, updates and the tiles executor in
layer_times.py; what autograd keeps per layer in saved_bytes.py; a model too big to step
whole in pieces.py; the memory guard in memory_guard.py; clocks, the stopwatch and a
timing's budget in clocks.py; the accelerator (its identity, memory and copy rate) in
accelerator.py; the device's fingerprint and the cache's files in cache.py. The names of
theirs that other modules use are importable from here too. Pairwise bandwidth comes from
swarm.profiling.bandwidth.measure_bandwidth; swarm/profiling/survey.py puts them together.
"""
from __future__ import annotations

import threading
from pathlib import Path

from planner.image_size import ImageSize
from planner.profile import DeviceProfile, ProfileError
from swarm.errors import SwarmError
from swarm.host import malloc
from swarm.host.resources import compute_threads
from swarm.profiling.accelerator import accelerator_identity, usable_accelerator
from swarm.profiling.cache import cache_path, default_state_dir, device_facts, read_profile, write_profile
from swarm.profiling.measure import DEFAULT_BATCH_SIZES, DEFAULT_REPEATS, default_classes, profile_model
from swarm.profiling.mapping import map_cost
from swarm.profiling.reduction import reduce_msg_cpu

# what other modules and tools import from here, from the modules that hold it
from swarm.profiling.accelerator import AcceleratorMemory  # noqa: F401
from swarm.profiling.cache import PROFILE_METHOD  # noqa: F401
from swarm.profiling.clocks import (CLOCKS, TIMING_BUDGET_S, Budget, ProfileStopped, QuotaClock,  # noqa: F401
                                    QuotaCPUClock, Stopwatch)
from swarm.profiling.memory_guard import CANNOT_PROFILE, OPTIMIZER_COPIES, MemoryGuard, settled_rss  # noqa: F401
from swarm.profiling.memory_guard import PeakRSS as _PeakRSS  # noqa: F401


def load_or_profile(model: str = "yolov2-16", img_size: ImageSize | int | None = None, classes: int | None = None,
                    state_dir: Path | None = None, batch_sizes=DEFAULT_BATCH_SIZES, repeats: int = DEFAULT_REPEATS,
                    threads: int | None = None, cfg_text: str | None = None, refresh: bool = False,
                    log=None, clock: str = "wall", accelerator: str = "cpu",
                    stop: threading.Event | None = None, memory_limit: int | None = None
                    ) -> tuple[DeviceProfile, bool, Path]:
    """The cached profile of this device for the model on `accelerator` ("cpu" or "cuda",
    as swarm.local.compute_device takes it), or a fresh one (then cached); a fresh one raises
    ProfileStopped once `stop` is set.
    Returns (profile, came from the cache, its path)."""
    from swarm.local.compute_device import compute_device
    from swarm.zoo import describe_model, model_source

    if cfg_text is None:
        _, cfg_text, _ = model_source(model)
        if classes is None:
            classes = default_classes(model, img_size)
    desc = describe_model(model, img_size, None, cfg_text)
    threads = threads or compute_threads()
    device = compute_device(accelerator)
    facts = device_facts(threads, accelerator_identity(device))
    path = cache_path(Path(state_dir or default_state_dir()), facts["fingerprint"], desc.name, desc.img_size,
                      classes, cfg_text)
    if clock != "wall":
        path = path.with_name(path.stem + f"-{clock}" + path.suffix)
    if path.exists() and not refresh:
        try:
            return read_profile(path), True, path
        except SwarmError:
            pass  # a stale or broken cache entry: measure again
    profile = profile_model(model, desc.img_size, classes, batch_sizes, repeats, threads, cfg_text, log=log,
                            clock=clock, device=device, stop=stop, memory_limit=memory_limit)
    write_profile(profile, path)
    return profile, False, path


PROFILE_JOB = "profile"
REDUCE_MSG = "reduce_msg_cpu_s"  # in a profile's device facts: swarm.profiling.reduction
MAP_COST = "map_cpu_s_per_byte"  # in a profile's device facts, on glibc as swarm starts it: swarm.profiling.mapping


async def run_profile_job(ctx) -> dict:
    """Job kind "profile", agent side: this device's profile (from its cache, else measured;
    measured again if "refresh") for spec {"model", "img_size" (N or "WxH"), "classes", "cfg",
    "batch_sizes", "repeats", "threads", "refresh", "accelerator"}, on the accelerator the
    agent offers ("accelerator": "cuda") where torch can use it, else on its CPU; within what the
    device can spare, less the agent's reserve."""
    import functools

    spec = ctx.spec
    stop = threading.Event()  # released while it measures: the thread gives up at its next timing
    call = functools.partial(load_or_profile, spec["model"], spec.get("img_size"), spec.get("classes"), None,
                             tuple(spec.get("batch_sizes") or DEFAULT_BATCH_SIZES),
                             int(spec.get("repeats") or DEFAULT_REPEATS), spec.get("threads"), spec.get("cfg"),
                             bool(spec.get("refresh")), accelerator=usable_accelerator(spec.get("accelerator")),
                             stop=stop, memory_limit=ctx.spare_memory())
    profile, cached, path = await ctx.run_in_thread(call, stop=stop)
    if REDUCE_MSG not in profile.device:  # a fresh profile, or one cached before it was measured
        profile.device[REDUCE_MSG] = await ctx.run_in_thread(reduce_msg_cpu)
        write_profile(profile, path)
    if MAP_COST not in profile.device and malloc.can_map():
        profile.device[MAP_COST] = await ctx.run_in_thread(map_cost)
        write_profile(profile, path)
    return {"profile": profile.to_dict(), "cached": cached}


async def profile_devices(cluster, node_ids: list[str], spec: dict, timeout: float = 3600.0,
                          accelerators: dict[str, str] | None = None) -> dict:
    """Coordinator side: the profile job on every node at once, each on the accelerator it
    offers (`accelerators`: {node id: "cpu" | "cuda"}, as advertised); {node id: DeviceProfile}."""
    import secrets

    import trio

    job = cluster.job(f"profile-{secrets.token_hex(4)}", 0)
    profiles = {}
    try:
        await job.assign_and_start(PROFILE_JOB, {
            node: dict(spec, accelerator=(accelerators or {}).get(node, "cpu")) for node in node_ids},
            all_or_raise=True)
        with trio.fail_after(timeout):
            for node in node_ids:
                result = await job.wait_done(node)
                try:
                    profiles[node] = DeviceProfile.from_dict(result["profile"])
                except (KeyError, ProfileError) as exc:
                    raise SwarmError(f"the profile from {node} is unusable: {exc}") from None
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await job.release_all()
    return profiles
