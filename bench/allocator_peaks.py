"""A training process's resident peak on each allocator setting, micro-batch after micro-batch.

    python bench/allocator_peaks.py [--model yolov2-16 --img-size 416 --samples 4 --iterations 6
        --rounds 3 --settings default,heap,mapped,mapped-small,mmap,jemalloc,tbb,pinned:32 --jemalloc PATH --tbb PATH
        --recompute off,on,segments --cpu 0.2 --mem 1G --layouts]

One process per setting and round (alternating: round 1 runs every setting, then round 2),
each training the whole model on one thread, `--iterations` forward-backward passes of
`--samples` samples (a list, such as 4,2,3, is taken in turn: micro-batches of varying size).
It prints, per setting, the median over the rounds of the resident peak above the process's
settled start after each pass, and the CPU time (user, system), page faults and wall time of the
passes; with `--live`, also the most bytes torch's own allocator held at once in one more pass
(the live tensors, from torch.profiler's memory events), which the resident peak exceeds by what
the allocator holds around them. With `--cpu` and `--mem` (root) each process runs in a cgroup
of that CPU quota and memory, as a testbed device does (swarm.testbed.cgroups); a run killed for
memory is counted.

    default   glibc as a plain Python process runs it (as torch's DDP does): blocks above its
              mmap threshold (up to 32 MiB, moving) mapped afresh

    before    glibc as swarm set it before: one arena, no mmap, freed memory kept
    heap      the above, and neither fastbins nor the per-thread cache (tcache): what the
              `swarm` command runs a training on, on glibc, where the kernel has no
              transparent huge pages (swarm.host.malloc)
    swarm     `heap` (what it runs a training on since 2026-12, so the same as `heap`)
    mapped    `heap` with the heap and its mappings in huge pages (glibc.malloc.hugetlb=1,
              as swarm ran glibc until 2026-12, "glibc-thp"), as a plan that maps its largest
              blocks ran (Plan.mapped): blocks of 4 MiB or more mapped afresh, unmapped on free
    mapped:N  the same, with blocks of N MiB or more mapped afresh
    mapped-small  `heap` as a plan that maps runs now: blocks of 4 MiB or more mapped
              afresh, in the kernel's small pages (mapped-small:N: of N MiB or more)
    mmap      one arena, and every block of 256 KiB or more its own mapping, unmapped on
              free (each pass faults its pages in again)
    jemalloc  jemalloc as swarm preloads it (where it is installed, or the library --jemalloc
              names: `apt-get download libjemalloc2 && dpkg -x libjemalloc2_*.deb DIR` gives one
              without installing it)
    jemalloc-oneheap  the same, and blocks of 8 MiB or more from its one arena too
              (oversize_threshold:0) rather than from the arena jemalloc keeps for them
    pinned:K  `heap`, and before torch is loaded 64 MiB of free K KiB holes at the heap's foot, each
              kept apart by a live 16-byte block: glibc serves a small request from the smallest
              free chunk that fits, so the small blocks of a pass go there rather than into the
              room a large activation freed
    tbb       oneTBB's scalable allocator, preloaded (libtbbmalloc_proxy.so.2, which the `tbb` wheel on
              PyPI carries for x86-64 only; --tbb names it): its large blocks cached for a while,
              then returned to the system; tbb:N caches every block of N MiB or more for good
              (TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD)

With `--recompute off,on` each setting runs twice a round: keeping every map the backward reads,
and remaking BatchNorm's output and its activation's result in the backward (swarm.zoo.recompute)
for every layer that has BatchNorm; the rows say `+rc`. The CPU time is then the passes' cost of
remaking them. `--recompute segments` runs the net in checkpointed segments instead
(planner.checkpoint; rows `+ck`): the passes' CPU is then a second forward.

The peaks are the kernel's high-water mark (swarm.profiling.memory_guard.PeakRSS), reset at the
start. On glibc, where the small blocks of the process land moves where the large ones can go:
the same passes peak differently from one process to the next with nothing but the order of
Python's dicts and sets (its hash seed) and the addresses the kernel chose changed. With
`--layouts` round r runs with PYTHONHASHSEED=r, so each round is another layout, the same one
in every setting and again in a later run. The `model` column is what the planner's memory
model (planner.memory: the allocator's model, with the form's) says the last pass holds above
the start, as tests/test_memory_model.py checks it: for the heap and mapped-small settings
glibc's, jemalloc's for jemalloc.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.commands.testbed_cmd import memory_size  # noqa: E402
from swarm.host import malloc  # noqa: E402

PASSES = r"""
import ctypes, json, resource, sys, time
setting, samples, size, iterations, model = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], \
    int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
recompute, segments = sys.argv[6] == "on", sys.argv[6] == "segments"
from swarm.host import malloc
if setting.startswith("mapped-small"):
    malloc.tune()
    malloc.map_large(True)
    if ":" in setting:
        ctypes.CDLL("libc.so.6").mallopt(malloc.M_MMAP_THRESHOLD, int(setting.split(":")[1]) << 20)
elif setting.startswith("mapped"):  # (its tunables are not swarm's: tune() would leave them alone)
    libc = ctypes.CDLL("libc.so.6")
    for option, value in ((malloc.M_ARENA_MAX, 1), (malloc.M_TRIM_THRESHOLD, 1 << 30), (malloc.M_MXFAST, 0),
                          (malloc.M_MMAP_MAX, malloc.MAX_MAPPED),
                          (malloc.M_MMAP_THRESHOLD, int(setting[7:] or "4") << 20)):
        libc.mallopt(option, value)
elif setting == "mmap":
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(malloc.M_ARENA_MAX, 1); libc.mallopt(-3, 256 << 10); libc.mallopt(malloc.M_TRIM_THRESHOLD, 1 << 30)
elif setting == "default":
    pass
elif setting == "before":
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(malloc.M_ARENA_MAX, 1); libc.mallopt(malloc.M_MMAP_MAX, 0); libc.mallopt(malloc.M_TRIM_THRESHOLD, 1 << 30)
else:
    malloc.tune()
    if setting.startswith("pinned:"):  # 64 MiB of free K KiB holes, each kept apart by a live 16-byte block
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        hole = int(setting.split(":")[1]) << 10
        held = [(libc.malloc(hole), libc.malloc(16)) for _ in range((64 << 20) // hole)]
        for block, _ in held:
            libc.free(block)
import torch
from swarm.profiling.memory_guard import PeakRSS
from swarm.profiling.profiler import settled_rss
from swarm.zoo import build_model
torch.set_num_threads(1)
net, desc, _ = build_model(model, size, classes=5, seed=1)
net.train()
if recompute:
    net.recompute = frozenset(l.index for l in desc.layers if l.kind in ("conv", "connected") and l.batch_normalize)
net.checkpoint = segments
net(torch.rand(1, *desc.layers[0].in_shape)).sum().backward()
base = settled_rss()
before = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.monotonic()
peaks = []
with PeakRSS() as rss:
    for i in range(iterations):
        net(torch.rand(samples[i % len(samples)], *desc.layers[0].in_shape)).float().pow(2).mean().backward()
        peaks.append((rss.peak - base) / 2**20)
after = resource.getrusage(resource.RUSAGE_SELF)
live = None
if sys.argv[7:] == ["live"]:  # one more pass, the most bytes torch's allocator held at once in it
    import os, tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        net(torch.rand(samples[0], *desc.layers[0].in_shape)).float().pow(2).mean().backward()
    fd, trace = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(trace)
    live = max([e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"] + [0]) / 2**20
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps({"wall": time.monotonic() - t0, "base": base / 2**20, "hwm": hwm, "allocator": malloc.allocator(),
                  "peaks": peaks, "user": after.ru_utime - before.ru_utime, "live": live,
                  "sys": after.ru_stime - before.ru_stime, "faults": after.ru_minflt - before.ru_minflt}))
"""


def environment(setting: str, jemalloc: str | None, tbb: str | None = None) -> dict[str, str] | None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "GLIBC_TUNABLES", malloc.PRELOADED)}
    env["PYTHONPATH"] = str(ROOT)
    if setting in ("heap", "swarm") or setting.startswith(("mapped-small", "pinned")):  # as `swarm` starts itself again
        env.update(GLIBC_TUNABLES=malloc.GLIBC_TUNABLES, **{malloc.PRELOADED: "glibc"})
    elif setting.startswith("mapped"):  # as it did until 2026-12, in huge pages
        env.update(GLIBC_TUNABLES=malloc.GLIBC_TUNABLES + ":glibc.malloc.hugetlb=1")
    elif setting in ("jemalloc", "jemalloc-oneheap"):
        library = jemalloc or malloc.jemalloc_library(fetch=True)
        if library is None:
            return None
        env.update(LD_PRELOAD=library, MALLOC_CONF=malloc.JEMALLOC_CONF)
        if setting == "jemalloc-oneheap":  # blocks of 8 MiB and more from the one arena too, not an arena of their own
            env["MALLOC_CONF"] += ",oversize_threshold:0"
    elif setting.split(":")[0] == "tbb":
        if tbb is None:
            return None
        env.update(LD_PRELOAD=tbb, LD_LIBRARY_PATH=str(Path(tbb).parent))
        if ":" in setting:
            env["TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD"] = str(int(setting.split(":")[1]) << 20)
    return env


def model_peak(args, row: str, allocator: str) -> str:
    """What the memory model says the last pass holds above the settled start, in MiB, for a
    row's allocator and form (as tests/test_memory_model.py predicts it); "-" where it has none."""
    from planner.checkpoint import checkpointing_model
    from planner.mapping import mapped_model
    from planner.memory import STAGE_SCRATCH_BYTES, MemoryModel
    from swarm.zoo import describe_model

    setting = row.split("+")[0]
    if allocator not in ("glibc", "jemalloc") or setting not in ("heap", "swarm", "mapped-small", "jemalloc", "jemalloc-oneheap"):
        return "-"  # (mapped-small:N maps from another size than the planner's MAPPED_FROM)
    desc = describe_model(args.model, args.img_size, 5)
    model, n = MemoryModel.for_devices(desc, allocator=allocator), len(desc.layers)
    if setting == "mapped-small":
        model = mapped_model(model)
    if row.endswith("+rc"):
        model = model.recomputing()
    elif row.endswith("+ck"):
        model = checkpointing_model(model)
    b = int(args.samples.split(",")[(args.iterations - 1) % len(args.samples.split(","))])
    return f"{(model.stage(0, n, b, 1) - model.weights(0, n) + STAGE_SCRATCH_BYTES) / 2**20:.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="yolov2-16")
    parser.add_argument("--img-size", type=int, default=416)
    parser.add_argument("--samples", default="4", help="samples a pass, or a list taken in turn (4,2,3)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default="before,heap,swarm,mapped,mmap,jemalloc")
    parser.add_argument("--jemalloc", help="the jemalloc library to preload (default: the installed one)")
    parser.add_argument("--tbb", help="oneTBB's libtbbmalloc_proxy.so.2, for the tbb setting")
    parser.add_argument("--recompute", default="off", help="any of off, on, segments (off,on,segments): BatchNorm "
                        "and activation remade in the backward (on), or checkpointed segments")
    parser.add_argument("--live", action="store_true", help="also the most bytes torch's allocator holds at once in "
                        "a pass of the first sample count (torch.profiler), beside the resident peak")
    parser.add_argument("--layouts", action="store_true", help="round r with PYTHONHASHSEED=r: another layout of "
                        "the process's small blocks each round, the same in every setting")
    parser.add_argument("--cpu", type=float, help="each process in a cgroup of this many cores (root)")
    parser.add_argument("--mem", type=memory_size, help="... and this much memory (1G, 800M)")
    args = parser.parse_args()
    in_cgroup, made = None, []
    if args.cpu is not None or args.mem is not None:
        from swarm.testbed import cgroups
        host = cgroups.detect()
        if host is None or os.geteuid() != 0:
            parser.error("--cpu and --mem need root and cgroups")
        dirs = cgroups.create_limits(host, "allocator-peaks", args.cpu, args.mem)
        in_cgroup = lambda: cgroups.add_process(dirs, os.getpid())  # noqa: E731 (in the child, before exec)
        made = dirs + host.group_dirs()  # removed after (a testbed's group stays: it is not empty)
    settings = [s for s in args.settings.split(",") if s]
    unknown = {s for s in settings if not (s.split(":")[0] in ("mapped", "mapped-small", "tbb", "pinned") and s.count(":") == 1
                                           and s.split(":")[1].isdigit())} - {
        "default", "mapped-small", "before", "heap", "swarm", "mapped", "mmap", "jemalloc", "jemalloc-oneheap", "tbb"}
    if unknown:
        parser.error(f"no setting {', '.join(sorted(unknown))}")
    modes = [m for m in args.recompute.split(",") if m]
    if not modes or set(modes) - {"off", "on", "segments"}:
        parser.error("--recompute takes off, on, segments or a list of them")
    rows = [(s, m) for s in settings for m in modes]
    suffix = {"off": "", "on": "+rc", "segments": "+ck"}
    runs: dict[str, list[dict]] = {s + suffix[m]: [] for s, m in rows}
    killed: dict[str, int] = {}
    for round_ in range(1, args.rounds + 1):
        for setting, mode in rows:
            env = environment(setting, args.jemalloc, args.tbb)
            if env is None:
                continue  # jemalloc (or tbb) not here
            if args.layouts:
                env["PYTHONHASHSEED"] = str(round_)
            out = subprocess.run([sys.executable, "-c", PASSES, setting, args.samples, str(args.img_size),
                                  str(args.iterations), args.model, mode, *(["live"] if args.live else [])],
                                 capture_output=True, text=True, env=env, cwd=ROOT, preexec_fn=in_cgroup)
            if out.returncode != 0:  # (killed for memory, under a limit: counted, the others go on)
                lines = out.stderr.strip().splitlines()[-1:] or [f"ended with {out.returncode}"]
                print(f"{setting}: {lines[0]}", file=sys.stderr)
                killed[setting + suffix[mode]] = killed.get(setting + suffix[mode], 0) + 1
                continue
            run = json.loads(out.stdout.strip().splitlines()[-1])
            if setting.startswith("tbb"):  # (swarm.host.malloc knows glibc and jemalloc only)
                run["allocator"] = "tbbmalloc"
            runs[setting + suffix[mode]].append(run)
    for d in made:  # the runs' cgroup, emptied
        cgroups.remove(d, wait=0.5)
    print(f"{args.model} at {args.img_size}, {args.samples} samples a pass, {args.iterations} passes, "
          f"{args.rounds} rounds; resident peak above the settled start, MiB (median; range of the last pass); "
          f"VmHWM: the process's own peak, its start included, MiB")
    print(f"{'setting':12} {'allocator':9} {'peak after each pass':48} {'last: min-max':14} {'user s':>7} "
          f"{'sys s':>6} {'faults':>8} {'wall s':>7} {'VmHWM':>6} {'model':>6}")
    for setting, done in runs.items():
        if not done:
            print(f"{setting:12} " + (f"ended early in all {killed[setting]} runs" if setting in killed else
                                      "(not installed)"))
            continue
        medians = [statistics.median(r["peaks"][i] for r in done) for i in range(args.iterations)]
        last = sorted(r["peaks"][-1] for r in done)
        print(f"{setting:12} {done[0]['allocator']:9} {' '.join(f'{m:.0f}' for m in medians):48} "
              f"{last[0]:.0f}-{last[-1]:.0f}{'':6} {statistics.median(r['user'] for r in done):7.2f} "
              f"{statistics.median(r['sys'] for r in done):6.2f} {statistics.median(r['faults'] for r in done):8.0f} "
              f"{statistics.median(r['wall'] for r in done):7.1f} {statistics.median(r['hwm'] for r in done):6.0f}"
              f" {model_peak(args, setting, done[0]['allocator']):>6}"
              + (f"  live {statistics.median(r['live'] for r in done):.0f}" if args.live else "")
              + (f"  ({killed[setting]} ended early)" if setting in killed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
