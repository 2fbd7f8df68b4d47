"""Per-device compute costs: forward, backward and update time of every layer at any batch size.

A CostTable holds times measured at a few batch sizes (the profiler's output) and
interpolates between them piecewise linearly — time is not linear in the batch size
(Asteroid, Fig. 6). Beyond the largest measured size it extends the last segment, unless
that segment is flatter than half the time per sample there (measurement noise): then it
grows in proportion to the batch. A FLOPs-based table stands in for a device described
only by its speed.

    table = CostTable.from_profile(profile_dict)
    table.fwd_range(0, 8, batch=4)      # seconds for layers 0..7 forward on 4 samples
    slow = table.scaled(0.25)           # a device a quarter as fast
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner.model_desc import ModelDesc


AFFINE_UP_TO = 4096  # analytical tables are given at batch 1 and this size: exactly affine between


@dataclass
class CostTable:
    """Times in seconds. fwd/bwd: (layers, len(batch_sizes)); update: (layers,) one optimizer
    step over the layer's parameters; loss_fwd/loss_bwd: (len(batch_sizes),) the loss head."""

    batch_sizes: tuple[int, ...]
    fwd: np.ndarray
    bwd: np.ndarray
    update: np.ndarray
    loss_fwd: np.ndarray
    loss_bwd: np.ndarray
    source: str = ""  # where the numbers come from, for reports ("measured on ...", "10 GFLOP/s")
    # the tiles executor's time over autograd's for the same layers and samples (its own
    # kernels and bookkeeping, no halos): a tile's share of a layer's time is scaled by it
    tiles_overhead: float = 1.0
    # what is derived from the times (prefix sums, interpolation weights): a copy (replace) starts afresh
    _cum: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.batch_sizes = tuple(int(b) for b in self.batch_sizes)
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes) or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"batch sizes must be increasing positive numbers, got {self.batch_sizes}")
        k = len(self.batch_sizes)
        self.fwd = np.asarray(self.fwd, dtype=float).reshape(-1, k)
        self.bwd = np.asarray(self.bwd, dtype=float).reshape(-1, k)
        self.update = np.asarray(self.update, dtype=float).reshape(-1)
        self.loss_fwd = np.asarray(self.loss_fwd, dtype=float).reshape(k)
        self.loss_bwd = np.asarray(self.loss_bwd, dtype=float).reshape(k)
        if not (self.fwd.shape == self.bwd.shape and self.update.shape[0] == self.fwd.shape[0]):
            raise ValueError("forward, backward and update times must cover the same layers")
        if min(self.fwd.min(initial=0), self.bwd.min(initial=0), self.update.min(initial=0)) < 0:
            raise ValueError("times cannot be negative")
        self.tiles_overhead = float(self.tiles_overhead)
        if not self.tiles_overhead > 0:
            raise ValueError(f"the tiles overhead must be positive, got {self.tiles_overhead}")
        # more samples never take less time: measurement noise that says so is smoothed away
        self.fwd = np.maximum.accumulate(self.fwd, axis=1)
        self.bwd = np.maximum.accumulate(self.bwd, axis=1)
        self.loss_fwd = np.maximum.accumulate(self.loss_fwd)
        self.loss_bwd = np.maximum.accumulate(self.loss_bwd)

    @property
    def num_layers(self) -> int:
        return self.fwd.shape[0]

    # ---- interpolation ---------------------------------------------------------------
    def weights(self, batch: float) -> tuple[int, int, float, float]:
        """(k0, k1, w0, w1): time(batch) = w0 * time[k0] + w1 * time[k1]."""
        bs = self.batch_sizes
        if batch <= 0:
            return 0, 0, 0.0, 0.0
        if len(bs) == 1:
            return 0, 0, batch / bs[0], 0.0
        if batch <= bs[0]:
            return 0, 0, batch / bs[0], 0.0
        k = int(np.searchsorted(bs, batch))
        if k >= len(bs):
            return self._beyond(batch)
        lo, hi = bs[k - 1], bs[k]
        w1 = (batch - lo) / (hi - lo)
        return k - 1, k, 1.0 - w1, w1

    def _beyond(self, batch: float) -> tuple[int, int, float, float]:
        """Past the largest measured size: the last segment, or proportional where it is too flat."""
        bs = self.batch_sizes
        k, lo, hi = len(bs) - 1, bs[-2], bs[-1]
        total = self.fwd.sum() + self.bwd.sum()
        last = self.fwd[:, k].sum() + self.bwd[:, k].sum()
        prev = self.fwd[:, k - 1].sum() + self.bwd[:, k - 1].sum()
        if total > 0 and (last - prev) / (hi - lo) < 0.5 * last / hi:
            return k, k, batch / hi, 0.0
        w1 = (batch - lo) / (hi - lo)
        return k - 1, k, 1.0 - w1, w1

    def _at(self, values: np.ndarray, batch: float) -> float:
        k0, k1, w0, w1 = self._weights_at(batch)
        return max(0.0, float(w0 * values[..., k0] + w1 * values[..., k1]))

    def _weights_at(self, batch: float) -> tuple[int, int, float, float]:
        """weights(batch), kept: the planners ask for a few sizes hundreds of thousands of times."""
        known = self._cum.setdefault("weights", {})
        got = known.get(batch)
        if got is None:
            got = self.weights(batch)
            if len(known) < 4096:
                known[batch] = got
        return got

    def _range_at(self, kind: str, first: int, last: int, batch: float) -> float:
        """_at of layers [first, last)'s summed times, from the prefix sums: the same arithmetic."""
        c = self.cumulative(kind)
        k0, k1, w0, w1 = self._weights_at(batch)
        return max(0.0, float(w0 * (c[last, k0] - c[first, k0]) + w1 * (c[last, k1] - c[first, k1])))

    def cumulative(self, kind: str) -> np.ndarray:
        """Prefix sums over layers, shape (layers + 1, len(batch_sizes)): range [i, j) is c[j] - c[i]."""
        if kind not in self._cum:
            values = {"fwd": self.fwd, "bwd": self.bwd}[kind]
            c = np.zeros((values.shape[0] + 1, values.shape[1]))
            np.cumsum(values, axis=0, out=c[1:])
            self._cum[kind] = c
        return self._cum[kind]

    def fwd_range(self, first: int, last: int, batch: float) -> float:
        return self._range_at("fwd", first, last, batch)

    def bwd_range(self, first: int, last: int, batch: float) -> float:
        return self._range_at("bwd", first, last, batch)

    def update_range(self, first: int, last: int) -> float:
        return float(self.update[first:last].sum())

    def loss_time(self, batch: float) -> tuple[float, float]:
        return self._at(self.loss_fwd, batch), self._at(self.loss_bwd, batch)

    def range_time(self, first: int, last: int, batch: float, with_loss: bool = False) -> float:
        """Forward plus backward of layers [first, last) (and the loss head) on `batch` samples."""
        t = self.fwd_range(first, last, batch) + self.bwd_range(first, last, batch)
        if with_loss:
            t += sum(self.loss_time(batch))
        return t

    def per_sample(self, batch: int) -> "CostTable":
        """The linear model HierTrain assumes: each layer's time per sample measured at `batch`."""
        k0, k1, w0, w1 = self.weights(batch)
        f = (w0 * self.fwd[:, k0] + w1 * self.fwd[:, k1]) / batch
        b = (w0 * self.bwd[:, k0] + w1 * self.bwd[:, k1]) / batch
        lf = (w0 * self.loss_fwd[k0] + w1 * self.loss_fwd[k1]) / batch
        lb = (w0 * self.loss_bwd[k0] + w1 * self.loss_bwd[k1]) / batch
        return CostTable((1,), f, b, self.update, [lf], [lb], self.source + f" (linear at batch {batch})",
                         self.tiles_overhead)

    # ---- derived tables --------------------------------------------------------------
    def scaled(self, speed: float) -> "CostTable":
        """A device `speed` times as fast (every time divided by `speed`)."""
        if not speed > 0:
            raise ValueError(f"a speed factor must be positive, got {speed}")
        return CostTable(self.batch_sizes, self.fwd / speed, self.bwd / speed, self.update / speed,
                         self.loss_fwd / speed, self.loss_bwd / speed, f"{self.source} x {speed:g}",
                         self.tiles_overhead)

    def to_dict(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "fwd": self.fwd.tolist(), "bwd": self.bwd.tolist(),
                "update": self.update.tolist(), "loss_fwd": self.loss_fwd.tolist(), "loss_bwd": self.loss_bwd.tolist(),
                "source": self.source, "tiles_overhead": self.tiles_overhead}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        return cls(tuple(d["batch_sizes"]), d["fwd"], d["bwd"], d["update"], d["loss_fwd"], d["loss_bwd"],
                   d.get("source", ""), d.get("tiles_overhead", 1.0))

    @classmethod
    def from_flops(cls, desc: ModelDesc, gflops: float, mem_gbps: float | None = None) -> "CostTable":
        """An analytical table: time = FLOPs / speed, plus bytes moved / memory bandwidth when
        that is given. Forward FLOPs per layer come from the model; backward is about twice
        the forward for layers with weights (input and weight gradients), once for the rest.
        Bytes moved: per sample, a layer's input and output (twice backward); per call,
        its weights (read forward; read, and gradient written, backward) — so time is
        affine in the batch size. An SGD update reads and writes about four floats per
        parameter."""
        if not gflops > 0:
            raise ValueError(f"gflops must be positive, got {gflops}")
        rate = gflops * 1e9
        f1 = np.array([layer.flops for layer in desc.layers], dtype=float) / rate
        b1 = np.array([layer.backward_flops for layer in desc.layers], dtype=float) / rate
        out = desc.layers[-1].out_bytes
        loss = out * 10 / rate  # a few operations per output value
        if not mem_gbps:
            src = f"{gflops:g} GFLOP/s"
            return cls((1,), f1, b1, np.zeros(len(desc.layers)), [loss], [loss], src)
        bw = float(mem_gbps) * 1e9
        moved = np.array([_in_bytes(desc, layer.index) + layer.out_bytes for layer in desc.layers], dtype=float) / bw
        weights = np.array([layer.param_bytes for layer in desc.layers], dtype=float) / bw
        per_f, per_b = f1 + moved, b1 + 2 * moved
        big = AFFINE_UP_TO
        f = np.column_stack([per_f + weights, big * per_f + weights])  # affine in the batch size
        b = np.column_stack([per_b + 2 * weights, big * per_b + 2 * weights])
        up = 4 * weights
        src = f"{gflops:g} GFLOP/s, {mem_gbps:g} GB/s"
        return cls((1, big), f, b, up, [loss, big * loss], [loss, big * loss], src)


def _in_bytes(desc: ModelDesc, index: int) -> int:
    layer = desc.layers[index]
    return sum(desc.input_bytes if s < 0 else desc.layers[s].out_bytes for s in layer.inputs)
