"""The memory model the planner checks real devices against covers what a stage really
holds: its peak resident size, measured in a process tuned as workers are."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from planner.memory import RESIDENT_SLACK, STAGE_SCRATCH_BYTES, MemoryModel
from swarm.zoo import describe_model

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


@pytest.mark.parametrize("first,last,k", [(0, 4, 1), (0, 4, 4), (4, 8, 3), (12, 17, 1)])
def test_stage_peak_is_within_the_device_memory_model(first, last, k):
    size = 320
    run = subprocess.run([sys.executable, "-c", STAGE, str(first), str(last), str(k), str(size)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
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
    bare = MemoryModel.estimated(desc)
    assert bare.stage(first, last, 1, k) - bare.weights(first, last) == pytest.approx(stage / RESIDENT_SLACK)
