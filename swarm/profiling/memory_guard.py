"""Keeping a profile within this device's memory.

The process's resident size, settled (`settled_rss`) and at its peak (`PeakRSS`), and
`MemoryGuard`: which batch sizes can be measured whole, or in which pieces a model too big
to step whole is measured, without the process outgrowing its memory (on a small device,
past its cgroup limit, the kernel kills the whole agent)."""
from __future__ import annotations

from swarm.host import malloc
from swarm.host.peaks import Peaks
from swarm.host.resources import spare_memory

OPTIMIZER_COPIES = {"sgd": 2, "adam": 3}  # weights + optimizer state, in floats per parameter
CANNOT_PROFILE = "cannot profile the model"  # the model is too big to measure whole on this device


def settled_rss() -> int:
    """Resident bytes after handing freed memory back to the system (the allocator keeps
    freed blocks otherwise, and the idle size would include the last step's activations)."""
    import psutil

    malloc.release()
    return psutil.Process().memory_info().rss


HIGH_WATER = "/proc/self/clear_refs"  # "5" resets the process's high-water mark (VmHWM), Linux 4.0 on


def _high_water() -> int | None:
    """The largest this process has been resident since the mark was last reset, in bytes."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRSS:
    """This process's largest resident size while open (`peak`, in bytes, also read inside the
    block). On Linux it is the kernel's own high-water mark, reset on entry: exact, at no cost.
    Elsewhere, or where /proc will not reset it, a thread samples the resident size every
    `interval` seconds (Peaks), which can miss a peak between readings."""

    def __init__(self, interval: float = 0.001):
        self.interval, self._sampled, self._last = interval, None, None

    @property
    def peak(self) -> int | None:
        if self._sampled is not None:
            return self._sampled.peak
        if self._last is not None:
            return self._last
        return _high_water()

    def __enter__(self):
        self._last, self._sampled = None, None
        try:
            with open(HIGH_WATER, "w") as marks:
                marks.write("5")
            if _high_water() is not None:
                return self
        except OSError:
            pass
        import psutil

        process = psutil.Process()
        self._sampled = Peaks(lambda: process.memory_info().rss, self.interval).__enter__()
        return self

    def __exit__(self, *exc):
        if self._sampled is not None:
            self._sampled.__exit__(*exc)
        else:
            self._last = _high_water()


class MemoryGuard:
    """Which batch sizes this process can profile without outgrowing its memory (a cgroup
    limit on a small device: profiling past it gets the whole agent killed). A batch size is
    run when the resident size now, plus its predicted peak above that, stays within a share
    of what the device can spare (`limit`, by default swarm.host.resources.spare_memory: the
    memory available, plus this process's own, less the default reserve). The peak is
    predicted per sample from the largest measured so far, or before any measurement from
    the memory model's estimate, with a margin for what neither sees (the allocator's slack,
    the temporaries of a backward); before the first step, also the gradients and optimizer
    state that step allocates (a model of 50 M parameters holds 400 MB of them under SGD,
    which a 1 GiB device does not have beside the model, its activations and the agent)."""

    SHARE = 0.85  # of the memory to spare; the rest for what the estimates miss and the kernel's
    MARGIN = 1.3  # measured peaks run 1.3-1.4x the estimate; measured per-sample peaks vary by ~1.2x

    def __init__(self, desc, optimizer: str, limit: int | None = None):
        from planner.memory import MemoryModel

        n = len(desc.layers)
        self.model = model = MemoryModel.estimated(desc, optimizer)
        self.estimate = model.activations(0, n, 1) + model.buffers(0, n, 1)  # bytes per sample
        self.state = OPTIMIZER_COPIES[optimizer] * sum(d.param_bytes for d in desc.layers)  # gradients, slots
        self.limit = limit if limit is not None else spare_memory()
        self.base = settled_rss()
        self.piece_extra = 0.0  # what pieces measured so far held beyond their estimate

    def per_sample(self, peak: dict[int, float]) -> float:
        return max((v / b for b, v in peak.items()), default=1.4 * self.estimate)

    def need(self, batch: int, peak: dict[int, float]) -> float:
        first = 0.0 if peak else self.state  # a measured peak includes them
        return self.base + first + self.MARGIN * batch * self.per_sample(peak)

    def __call__(self, batch: int, peak: dict[int, float]) -> bool:
        return self.need(batch, peak) <= self.SHARE * self.limit

    def reason(self, batch: int, peak: dict[int, float]) -> str:
        return (f"would need about {self.need(batch, peak) / 2**20:.0f} MiB of this device's "
                f"{self.limit / 2**20:.0f} MiB")

    def too_small(self, batch: int, layer: int | None = None) -> str:
        what = "a step" if layer is None else f"layer {layer} alone"
        need = self.need(batch, {}) if layer is None else self.piece_need(batch, layer, layer + 1)
        return (f"this device {CANNOT_PROFILE}: {what} on {batch} sample{'s' if batch > 1 else ''} would need "
                f"about {need / 2**20:.0f} MiB of this device's {self.limit / 2**20:.0f} MiB; profile a smaller "
                "--img-size or describe the device with --devices CLUSTER.json")

    # ---- a model too big to measure whole: its layers in pieces ---------------------------
    def piece_need(self, batch: int, first: int, last: int) -> float:
        """A training pass over layers [first, last) alone, on `batch` samples: the model
        (in the resident size already), the piece's gradients, what passes measured so far
        held beyond their estimate, and, with the margin, the piece's saved activations, its
        largest backward's buffers and the maps it takes in."""
        return self.base + float(self.model.param_bytes[first:last].sum()) + self.piece_extra \
            + self.MARGIN * 1.4 * batch * self._piece_per_sample(first, last)

    def _piece_per_sample(self, first: int, last: int) -> float:
        m = self.model
        return m.activations(first, last, 1) + m.buffers(first, last, 1) + m.boundary(first)

    def measured_piece(self, batch: int, first: int, last: int, peak: float) -> None:
        """Passes over a piece peaked at `peak` resident bytes, and the process has settled
        back to `self.base` since (what the first pass keeps for good, torch's own buffers,
        is in the base from then on): what they held beyond the estimate is held by every
        later piece too (kernel scratch, the allocator's slack; at small sizes it is most
        of a peak and does not grow with the batch)."""
        expected = float(self.model.param_bytes[first:last].sum()) + 1.4 * batch * self._piece_per_sample(first, last)
        self.piece_extra = max(self.piece_extra, peak - self.base - expected)

    def pieces(self, batch: int) -> list[tuple[int, int]] | None:
        """The fewest contiguous layer ranges, each measured alone within the share of memory
        (greedy from the first layer: the longest piece that fits, then the next); None when
        some layer alone does not fit."""
        n, out, first = len(self.model.desc.layers), [], 0
        while first < n:
            last = first
            while last < n and self.piece_need(batch, first, last + 1) <= self.SHARE * self.limit:
                last += 1
            if last == first:
                return None
            out.append((first, last))
            first = last
        return out

    def first_too_big(self, batch: int) -> int:
        """The first layer that does not fit alone on `batch` samples."""
        n = len(self.model.desc.layers)
        return next(i for i in range(n) if self.piece_need(batch, i, i + 1) > self.SHARE * self.limit)
