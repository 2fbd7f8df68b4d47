"""The largest value a reading takes while something runs, sampled in a thread."""
from __future__ import annotations

import threading
from typing import Callable


class Peaks:
    """Calls `read()` every `interval` seconds while open (once on entry, once on exit);
    `peak` is the largest value seen: a number, or for a reading that is a dict, the
    largest per key. A reading that fails with OSError or ValueError (a file going away)
    is skipped. A peak between two readings can be missed."""

    def __init__(self, read: Callable[[], float | dict], interval: float):
        self.read, self.interval, self.peak = read, interval, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        try:
            now = self.read()
        except (OSError, ValueError):
            return
        if isinstance(now, dict):
            peak = dict(self.peak or {})
            for key, value in now.items():
                peak[key] = max(value, peak.get(key, value))
            self.peak = peak
        else:
            self.peak = now if self.peak is None else max(self.peak, now)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
