"""The tiles executor's max-pool against its former forms, inside a real tiled pass.

    python bench/tiles_maxpool.py [--img-size 208] [--batch 4] [--grids 1x1,2x2] [--rounds 5]

yolov2-16 through the tiles executor on one thread; the forms take turns in one process:
torch's kernel on a channels-last copy (what the executor runs), torch's kernel on the
contiguous layout, and k*k strided passes (kept as the reference in tests/test_tiles_ops.py).
Prints, per grid and form, the median CPU time of a whole forward + backward pass and of the
part spent in the max-pool (forward and backward).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--img-size", type=int, default=208)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--grids", default="1x1,2x2")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import torch

    from swarm.host import malloc
    from swarm.zoo import build_model
    from tests.test_tiles_ops import reference_forward, reference_input_grad
    from tiles import ops
    from tiles.grouping import Grouping, parse_grid
    from tiles.whole_stage import InProcessStage

    torch.set_num_threads(1)
    def contiguous_forward(xp, kernel, stride):  # the same selection, from the (B, C, H, W) kernel
        wp = xp.shape[3]
        y, idx = torch.ops.aten.max_pool2d_with_indices(xp, [kernel, kernel], [stride, stride], [0, 0], [1, 1], False)
        idx.sub_(ops._window_starts(*y.shape[2:], wp, stride, idx.device))
        return y, ops._code_of_offset(kernel, wp, idx.device).take(idx)

    forms = {"channels-last": (ops.maxpool_forward, ops.maxpool_input_grad),
             "contiguous": (contiguous_forward, ops.maxpool_input_grad),
             "k*k passes": (reference_forward, reference_input_grad)}
    spent = [0.0]

    def timed(fn):
        def run(*a):
            t = time.process_time()
            try:
                return fn(*a)
            finally:
                spent[0] += time.process_time() - t
        return run

    net, desc, _ = build_model("yolov2-16", args.img_size, classes=5, seed=1)
    net.train()
    n = len(desc.layers)
    x = torch.rand(args.batch, 3, args.img_size, args.img_size)
    dy = torch.randn(args.batch, *desc.layers[n - 1].out_shape)
    print(f"yolov2-16 at {args.img_size}, batch {args.batch}, one thread: CPU ms per forward + backward "
          f"(median of {args.rounds})")
    for text in args.grids.split(","):
        stage = InProcessStage.build(net.layers, desc.layers, parse_grid(text), Grouping.every_layer(0, n), False)
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, (fwd, bwd) in forms.items():
                ops.maxpool_forward, ops.maxpool_input_grad = timed(fwd), timed(bwd)
                for _ in range(2):  # the first warms up
                    spent[0] = 0.0
                    t = time.process_time()
                    stage.forward(0, x, (1,) * args.batch)
                    stage.backward(0, dy)
                    total = time.process_time() - t
                got[name].append((total, spent[0]))
        for name, runs in got.items():
            print(f"tiles {text:<4} {name:<14} pass {statistics.median(a for a, _ in runs) * 1e3:6.0f}   "
                  f"max-pool {statistics.median(b for _, b in runs) * 1e3:5.0f}")


if __name__ == "__main__":
    main()
