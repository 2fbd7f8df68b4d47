"""Peaks keeps the largest reading, per key for readings that are dicts, and skips a
reading that fails."""
from __future__ import annotations

import time

import pytest

from swarm.host.peaks import Peaks


def test_the_largest_reading_is_kept_per_key_and_failed_readings_are_skipped():
    readings = iter([{"a": 1}, {"a": 5, "b": 2}, OSError("gone"), {"a": 3, "b": 7}])

    def read():
        now = next(readings, {"a": 0})
        if isinstance(now, Exception):
            raise now
        return now

    with Peaks(read, 0.001) as peaks:
        time.sleep(0.05)
    assert peaks.peak == {"a": 5, "b": 7}


def test_a_number_is_read_on_entry_and_exit_however_short_the_run():
    values = iter([4.0, 9.0])
    with Peaks(lambda: next(values), 3600) as peaks:
        pass
    assert peaks.peak == 9.0


def test_a_resident_peak_is_the_kernels_high_water_mark_however_short_it_was():
    """PeakRSS on Linux reads the high-water mark it reset on entry: a block touched and freed
    between two samples counts whole, and what was resident before entry does not."""
    import mmap

    from swarm.profiling import memory_guard
    from swarm.profiling.memory_guard import PeakRSS

    size = 64 << 20

    def touched_and_freed():
        block = mmap.mmap(-1, size)
        for page in range(0, size, mmap.PAGESIZE):
            block[page] = 1
        block.close()

    touched_and_freed()  # a peak before the measurement: not counted
    if memory_guard._high_water() is None:
        pytest.skip("no /proc/self/status here: PeakRSS samples")
    with PeakRSS(interval=3600) as rss:  # sampling would read only on entry and exit, missing the block
        start = memory_guard._high_water()
        touched_and_freed()
    assert rss.peak - start >= 0.95 * size
    assert rss.peak - start < size + (32 << 20)


def test_where_the_high_water_mark_cannot_be_reset_the_resident_size_is_sampled(monkeypatch, tmp_path):
    import mmap

    from swarm.profiling import memory_guard
    from swarm.profiling.memory_guard import PeakRSS

    import psutil

    monkeypatch.setattr(memory_guard, "HIGH_WATER", str(tmp_path / "absent" / "clear_refs"))
    size = 64 << 20
    start = psutil.Process().memory_info().rss
    with PeakRSS(interval=0.001) as rss:
        block = mmap.mmap(-1, size)
        for page in range(0, size, mmap.PAGESIZE):
            block[page] = 1
        time.sleep(0.05)  # held long enough for the sampler to see it
        block.close()
    assert rss._sampled is not None and rss.peak - start >= 0.95 * size
