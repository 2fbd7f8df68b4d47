"""Peak activation memory of one tile vs the untiled stage, measured as physical memory of a process.

    python bench/tiles_memory.py --img-size 416 --grid 4x4 --sync all [--batch 1]   # prints JSON

How it measures (run in a fresh process; bench/tiles_bench.py starts one per configuration
with MALLOC_MMAP_THRESHOLD_=65536, so that glibc gives every tensor of 64 KiB or more its
own mapping and returns it to the system when freed; resident memory then follows the live
tensors instead of a heap that only grows):
  - the network's weights and their .grad buffers exist before measuring (zeros), so
    weights, gradients and the optimizer are not counted, in either case;
  - untiled: the stage input and dL/d(output) exist beforehand; the peak of
    VmHWM - VmRSS (after resetting the high-water mark through /proc/self/clear_refs) over
    net forward + backward with autograd is the untiled activation peak;
  - tiled: all tiles first run in lockstep once, recording every answer each tile receives
    (halo rectangles, BatchNorm sums). Then each tile runs *alone* against that recording,
    as a device holding only that tile would: its input rectangle and owned output delta
    exist beforehand, halos are copied in as they "arrive", and the same high-water mark is
    taken over its forward and backward.
Everything the process touches is counted: activations kept for backward, the live maps
of the current layer, temporaries inside torch ops (padding copies, convolution
workspaces), received halos. Also reported: bytes the executor keeps from forward to
backward (Saved.nbytes) and, untiled, bytes autograd saves (saved_tensors_hooks, distinct
storages), and the cost model's estimate.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Reset the resident high-water mark; returns the resident KiB now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def peak_since(base_kib: int) -> int:
    return (_status_kib("VmHWM") - base_kib) * 1024


def build(img_size: int, batch: int):
    import torch

    from swarm.zoo import build_model

    net, desc, _ = build_model("yolov2-16", img_size, classes=20, seed=0)
    net.train()
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.rand(batch, 3, img_size, img_size)
    return net, desc, x


def measure_untiled(img_size: int, batch: int) -> dict:
    import torch

    net, desc, x = build(img_size, batch)
    dy = torch.randn(batch, *desc.layers[-1].out_shape)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    base = reset_peak()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = net(x)
    y.backward(dy)
    del y
    return {"peak_bytes": peak_since(base), "saved_bytes": sum(saved.values())}


def measure_tiles(img_size: int, batch: int, grid: tuple[int, int], sync: str) -> dict:
    import torch

    from tiles.cost import stage_cost
    from tiles.driver import run_lockstep
    from tiles.executor import TileWorker
    from tiles.grouping import Grouping
    from tiles.ops import crop
    from tiles.regions import Rect
    from tiles.whole_stage import InProcessStage

    net, desc, x = build(img_size, batch)
    n = len(desc.layers)
    stage = InProcessStage.build(net.layers, desc.layers, grid, Grouping.parse(sync, 0, n), input_delta=False)
    lay = stage.layout
    whole_in, whole_out = Rect.of(0, img_size, 0, img_size), Rect.of(0, *lay.map_shape(n)[1:2], 0, lay.map_shape(n)[2])
    dy = torch.randn(batch, *lay.map_shape(n))
    answers: dict[int, list] = {k: [] for k in range(lay.n_tiles)}

    def recording(k, gen):
        answer = None
        while True:
            try:
                req = gen.send(answer)
            except StopIteration as stop:
                return stop.value
            answer = yield req
            answers[k].append([a.clone() for a in answer] if isinstance(answer, list) else answer.clone())

    run_lockstep([recording(k, w.forward(0, crop(x, whole_in, lay.input_rect(k)))) for k, w in enumerate(stage.workers)])
    run_lockstep([recording(k, w.backward(0, crop(dy, whole_out, lay.output_rect(k))))
                  for k, w in enumerate(stage.workers)])

    def replay(k, gen, feed):
        answer = None
        while True:
            try:
                gen.send(answer)
            except StopIteration as stop:
                return stop.value
            got = next(feed)
            answer = [a.clone() for a in got] if isinstance(got, list) else got  # a halo "arrives"

    peaks, saved = [], []
    for k in range(lay.n_tiles):
        worker = TileWorker(lay, k, list(net.layers), keeps_running_stats=False)
        x_k = crop(x, whole_in, lay.input_rect(k)).clone()
        dy_k = crop(dy, whole_out, lay.output_rect(k)).clone()
        feed = iter(answers[k])
        base = reset_peak()
        replay(k, worker.forward(1, x_k), feed)
        saved.append(worker.saved_bytes(1))
        replay(k, worker.backward(1, dy_k), feed)
        peaks.append(peak_since(base))
        del worker
    model = stage_cost(lay)
    return {"peak_bytes": peaks, "saved_bytes": saved,
            "model_peak_bytes": [t.peak_bytes * batch for t in model.tiles],
            "model_saved_bytes": [t.saved_bytes * batch for t in model.tiles]}


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-size", type=int, default=416)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grid", default="untiled", help="RxC, or 'untiled'")
    p.add_argument("--sync", default="all")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.grid == "untiled":
        out = measure_untiled(args.img_size, args.batch)
    else:
        rows, cols = (int(v) for v in args.grid.split("x"))
        out = measure_tiles(args.img_size, args.batch, (rows, cols), args.sync)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
