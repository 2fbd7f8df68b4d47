"""Clusters described in a line, for tests, benchmarks and examples: devices by GFLOP/s and
memory, one bandwidth for every pair unless given per pair.

    cluster = flops_cluster(desc, {"pi-1": (2.0, "900 MiB"), "jetson": (20.0, "3 GiB")}, mbps=100,
                            data_source="pi-1", links={("pi-1", "jetson"): 50})
"""
from __future__ import annotations

import numpy as np

from planner.cluster import Cluster, Device
from planner.costs import CostTable
from planner.model_desc import ModelDesc
from planner.units import mbit_to_bytes_per_s, parse_bytes


def flops_cluster(desc: ModelDesc, devices: dict[str, tuple], mbps: float = 100.0, latency_ms: float = 0.0,
                  data_source: str | None = None, links: dict[tuple[str, str], float] | None = None,
                  directed: bool = False, tiers: dict[str, str] | None = None,
                  mem_gbps: float | None = None) -> Cluster:
    """devices: name -> (GFLOP/s, memory). links: (a, b) -> Mbit/s (both ways unless `directed`)."""
    names = list(devices)
    devs = [Device(n, CostTable.from_flops(desc, float(g), mem_gbps), parse_bytes(m), (tiers or {}).get(n))
            for n, (g, m) in devices.items()]
    n = len(names)
    bw = np.full((n, n), mbit_to_bytes_per_s(mbps))
    for (a, b), rate in (links or {}).items():
        bw[names.index(a), names.index(b)] = mbit_to_bytes_per_s(rate)
        if not directed:
            bw[names.index(b), names.index(a)] = mbit_to_bytes_per_s(rate)
    return Cluster(devs, bw, latency_ms / 1000, data_source)


def scaled_cluster(table: CostTable, devices: dict[str, tuple], mbps: float = 100.0, latency_ms: float = 0.0,
                   data_source: str | None = None) -> Cluster:
    """devices: name -> (speed relative to `table`, memory)."""
    devs = [Device(n, table.scaled(float(s)), parse_bytes(m)) for n, (s, m) in devices.items()]
    n = len(devs)
    return Cluster(devs, np.full((n, n), mbit_to_bytes_per_s(mbps)), latency_ms / 1000, data_source)
