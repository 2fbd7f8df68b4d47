"""A gradient sum's own work per message, as the profile job measures it and the planner
charges it (swarm.profiling.reduction, planner.cluster.Device.reduce_msg_s)."""
from __future__ import annotations

import pytest

from planner.classes import device_classes
from planner.cluster import Cluster, Device
from planner.costs import CostTable
from swarm.profiling.reduction import bare_message_cpu, reduce_msg_cpu, sum_message_cpu
from swarm.profiling.survey import reduce_msg_time


def test_a_sum_does_more_a_message_than_a_bare_swap():
    """Each message of a sum also starts a task, checks the shape that came and adds it in:
    measured on one thread's CPU clock, more than a bare swap's, and the difference is what
    the profile records. Each sum is measured right after a bare swap and the differences'
    median is held, so that a machine busy with other work slows both sides of each pair
    (the least of three of each, taken apart, failed once in a CI run on a loaded host)."""
    import statistics

    bare_message_cpu(20), sum_message_cpu(20)  # the interpreter's caches warmed
    pairs = [(bare_message_cpu(20), sum_message_cpu(20)) for _ in range(7)]
    assert all(0 < bare < 0.01 and 0 < summed < 0.01 for bare, summed in pairs), pairs
    assert statistics.median(summed - bare for bare, summed in pairs) > 0, pairs
    assert 0 < reduce_msg_cpu() < 0.01  # the profile's own figure: a median of pairs (one pair read 0 in CI)


@pytest.mark.parametrize("facts, expected", [
    ({"reduce_msg_cpu_s": 20e-6, "cpu_quota": 0.2}, 100e-6),  # a fifth of a core: five times as long
    ({"reduce_msg_cpu_s": 20e-6, "cpu_quota": None}, 20e-6),
    ({"reduce_msg_cpu_s": 20e-6, "cpu_quota": 3.0}, 20e-6),  # one sum runs on one core whatever the quota
    ({"cpu_quota": 0.5}, 0.0),  # a profile from before it was measured
])
def test_the_profiles_figure_is_spread_over_the_devices_quota(facts, expected):
    assert reduce_msg_time(facts) == pytest.approx(expected)


def test_devices_whose_sums_cost_differently_are_not_one_class():
    import numpy as np

    table = CostTable((1,), np.ones(2), np.ones(2), np.ones(2), np.ones(1), np.ones(1))
    devices = [Device(f"d{i}", table, memory=2**30, msg_s=1e-4, reduce_msg_s=r)
               for i, r in enumerate((2e-5, 2e-5, 8e-5))]
    cluster = Cluster(devices, np.full((3, 3), 1e8), latency=1e-3)
    assert device_classes(cluster) == [0, 0, 2]
