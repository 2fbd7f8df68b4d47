"""What remaking BatchNorm and its activation in the backward costs and saves (swarm.zoo.recompute).

A layer that remakes keeps one map instead of two or three (MemoryModel.recomputing), and its
backward runs BatchNorm (its statistics and its normalisation) and the activation once more
over the layer's output: a pass over memory, whose time against the layer's forward is the
larger the fewer multiply-adds each output element costs the conv. Measured on one core
(x86, float32): BatchNorm's training forward plus leaky over a 2x64x208x208 map took 17 ms,
3.1 ns an element, where a 3x3 conv of 32 channels into it took 0.22 ns a multiply-add: an
element remade costs about RECOMPUTE_MACS_PER_ELEMENT multiply-adds of the conv. Whole
training passes (python bench/recompute_time.py, one thread, a quiet machine) took 1.10x as
long for yolov2-16 at 416 (a 3x3 conv of 32-512 channels an element), 1.08x for yolov4-tiny at
256, 1.29x for mobilenetv2 at 128 (depthwise convs: 9 multiply-adds an element).

A plan remakes in all its single and dp stages or in none (Stage.recompute); `auto` plans
both ways and keeps the faster (planner.planners.plan_auto).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.cluster import Cluster
from planner.costs import CostTable
from planner.memory import MemoryModel, recomputable
from planner.model_desc import BYTES_PER_FLOAT, ModelDesc

RECOMPUTE_MACS_PER_ELEMENT = 14.0


def remake_share(desc: ModelDesc) -> np.ndarray:
    """(layers,): the share of each layer's forward time that remaking its BatchNorm output and
    activation result takes again in its backward (0 for a layer that does not remake)."""
    share = np.zeros(len(desc.layers))
    for i in recomputable(desc):
        layer = desc.layers[i]
        elements = layer.out_bytes / BYTES_PER_FLOAT
        remake = RECOMPUTE_MACS_PER_ELEMENT * elements
        share[i] = remake / (layer.flops / 2 + remake)
    return share


def _remaking(costs: CostTable, share: np.ndarray) -> CostTable:
    return replace(costs, bwd=costs.bwd + costs.fwd * share[:, None], source=costs.source + " + remaking")


def recomputing(mem: MemoryModel, cluster: Cluster, desc: ModelDesc) -> tuple[MemoryModel, Cluster]:
    """The memory model and devices of plans whose stages remake (idempotent)."""
    if cluster.recomputing:
        return mem.recomputing(), cluster
    share = remake_share(desc)
    devices = [replace(d, costs=_remaking(d.costs, share),
                       cpu_costs=_remaking(d.cpu_costs, share) if d.cpu_costs is not None else None)
               for d in cluster.devices]
    return mem.recomputing(), replace(cluster, devices=devices, recomputing=True)
