"""The clocks a profile times with, and how long each timing goes on.

The wall clock, this thread's CPU time, or a cgroup CPU quota's time (QuotaClock for whole
steps, QuotaCPUClock for single layers); the Stopwatch that marks the device that computes
(CUDA events on a GPU); the Budget of repeats a timing gets, which a released profile job
calls off (ProfileStopped).

    watch = Stopwatch(device, CLOCKS["wall"])
    seconds = median_time(step, Budget(repeats=5), watch)
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import NamedTuple

from swarm.errors import SwarmError

TIMING_BUDGET_S = 3.0  # a timing repeats (up to `repeats` times) until it has run this long: on a slow
                       # device one multi-second step is as exact as five, and five cost minutes


CLOCKS = {
    "wall": time.perf_counter,
    # this thread's CPU time: what one thread computes, whatever else shares the machine
    # (one compute thread only; for measuring on a busy machine)
    "cpu": time.thread_time,
}


class QuotaClock:
    """Wall time as a cgroup CPU quota makes it. Under a quota of q cores a computation runs at
    full speed until the period's share is spent, then waits for the next period; a short
    timing (one layer) mostly misses the waits, so medians of them tell the speed of the
    host's core, not the device's. This clock advances by the larger of the wall time and the
    process's CPU time / q since it was last read: a layer costs what it costs once the quota
    is spread over a long run, as in training."""

    def __init__(self, quota: float):
        self.quota = quota
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.value = 0.0

    def __call__(self) -> float:
        wall, cpu = time.perf_counter(), time.process_time()
        self.value += max(wall - self.wall, (cpu - self.cpu) / self.quota)
        self.wall, self.cpu = wall, cpu
        return self.value


class QuotaCPUClock:
    """CPU time spread over a quota of q cores: the process's CPU seconds / q. For timings
    too short to meet the throttling evenly (a layer), where QuotaClock's larger-of-the-two
    rounds each one up; whole steps, timed with QuotaClock, still see a busy host."""

    def __init__(self, quota: float):
        self.quota = quota

    def __call__(self) -> float:
        return time.process_time() / self.quota


class Stopwatch:
    """Marks on the timeline of the device that computes, and the seconds between them. On
    CUDA a mark is an event recorded on the current stream, so the time is the GPU's between
    the marks, not the host's queueing of kernels; `settle` waits for them before any reading.
    Elsewhere a mark is a reading of the clock `now`."""

    def __init__(self, device, now=time.perf_counter):
        self.device, self.now = device, now
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return self.now()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def settle(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def seconds(self, start, end) -> float:
        """Between two marks (settled)."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class ProfileStopped(SwarmError):
    """The profile was called off (its job released) before it was done."""


class Budget(NamedTuple):
    """How far each timing goes: up to `repeats` runs, as many as fit in TIMING_BUDGET_S, and
    none once `stop` is set (a profile job released while it measures)."""
    repeats: int
    stop: threading.Event | None = None


def median_time(fn, budget: Budget, watch: Stopwatch) -> float:
    """Median seconds of up to `budget.repeats` calls: as many as run within TIMING_BUDGET_S (at least one)."""
    marks = []
    for _ in within_budget(budget):
        t0 = watch.mark()
        fn()
        marks.append((t0, watch.mark()))
    watch.settle()
    return statistics.median(watch.seconds(a, b) for a, b in marks)


def within_budget(budget: Budget):
    """0, 1, ... up to `budget.repeats` - 1, stopping once TIMING_BUDGET_S of wall time has passed
    since the first (which always runs); ProfileStopped before any run once `budget.stop` is set."""
    start = time.perf_counter()
    for r in range(budget.repeats):
        if budget.stop is not None and budget.stop.is_set():
            raise ProfileStopped("the profile was called off")
        if r and time.perf_counter() - start >= TIMING_BUDGET_S:
            return
        yield r
