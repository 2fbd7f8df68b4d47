"""Peaks keeps the largest reading, per key for readings that are dicts, and skips a
reading that fails."""
from __future__ import annotations

import time

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
