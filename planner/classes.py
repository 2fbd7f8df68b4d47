"""Devices of one kind: the classes the planners' searches count instead of single devices.

A classroom of sixty Pi 4s of five kinds is five classes. Two devices are of one class when
they compute alike (cost tables equal within CLASS_TOLERANCE, the same batch sizes measured,
the same accelerator, tier and energy figures), hold alike (memory budgets within the
tolerance) and are reached alike (the same rate to and from every other device, and between
the two, within the tolerance; the same time per byte and per message). A search that asks
what a group of devices costs asks it once per class make-up of the group, of its first
group with that make-up: swapping a device for another of its class changes no cost the
searches use beyond the tolerance, and every plan they propose is then simulated on each
device's own figures.

    kinds = device_classes(cluster)      # per device (cluster order), the index of its class's first device
"""
from __future__ import annotations

import numpy as np

from planner.cluster import Cluster, Device

# how far two devices' figures may differ and still be planned as one kind: profiles of
# one kind of board taken apart differ by noise of about this much
CLASS_TOLERANCE = 0.01


def device_classes(cluster: Cluster, tolerance: float = CLASS_TOLERANCE) -> list[int]:
    """Each device's class, as the cluster index of the class's first device."""
    if tolerance not in cluster.class_cache:
        firsts: list[int] = []
        kinds = []
        for i in range(len(cluster.devices)):
            match = next((f for f in firsts if _alike(cluster, f, i, tolerance)), None)
            if match is None:
                firsts.append(i)
                match = i
            kinds.append(match)
        cluster.class_cache[tolerance] = tuple(kinds)
    return list(cluster.class_cache[tolerance])


def _close(a, b, tolerance: float) -> bool:
    return bool(np.allclose(a, b, rtol=tolerance, atol=0.0))


def _alike(cluster: Cluster, i: int, j: int, tolerance: float) -> bool:
    a, b = cluster.devices[i], cluster.devices[j]
    return _computes_alike(a, b, tolerance) and _reached_alike(cluster, i, j, tolerance)


def _computes_alike(a: Device, b: Device, tolerance: float) -> bool:
    ca, cb = a.costs, b.costs
    if (ca.batch_sizes != cb.batch_sizes or a.accelerator != b.accelerator or a.tier != b.tier
            or a.power_w != b.power_w or a.radio != b.radio):
        return False
    return (all(_close(getattr(ca, k), getattr(cb, k), tolerance)
                for k in ("fwd", "bwd", "update", "loss_fwd", "loss_bwd", "tiles_overhead"))
            and _close(a.memory, b.memory, tolerance)
            and _close([a.comm_s_per_byte, a.msg_s, a.reduce_msg_s, a.map_s_per_byte, a.lane_s_per_byte, a.lane_msg_s, a.step_s],
                       [b.comm_s_per_byte, b.msg_s, b.reduce_msg_s, b.map_s_per_byte, b.lane_s_per_byte, b.lane_msg_s, b.step_s],
                       tolerance))


def _reached_alike(cluster: Cluster, i: int, j: int, tolerance: float) -> bool:
    bw = cluster.bandwidth
    others = np.ones(len(cluster.devices), dtype=bool)
    others[[i, j]] = False
    return (_close(bw[i, others], bw[j, others], tolerance) and _close(bw[others, i], bw[others, j], tolerance)
            and _close(bw[i, j], bw[j, i], tolerance))
