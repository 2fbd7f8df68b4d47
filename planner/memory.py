"""The memory a stage needs on a device (Asteroid eq. 3): weights, gradients, optimizer state,
and K_p micro-batches of saved activations, plus the transient buffers of one backward.

    Mem_p(beta) = Mem(MOD)_p + Mem(OPT)_p + K_p * Mem(ACT)_p(beta)

Activation bytes per layer are what autograd keeps for the backward pass, per sample:
measured by the profiler (saved tensors, counted once, charged to the first layer that
keeps them, so a layer's own input is charged to it) or, without a profile, estimated from
the layer's shapes in the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from planner.model_desc import BYTES_PER_FLOAT, ModelDesc

OPTIMIZER_STATE_FLOATS = {"sgd": 1, "adam": 2, "plain-sgd": 0}  # extra floats per parameter

# A process holds more than the tensors autograd keeps: the allocator's free blocks between
# them and the temporaries of the last layer run. Plans for real devices use this factor on
# glibc (MemoryModel.for_devices); the model alone (slack 1) is the papers' equation. It was
# 1.5 while glibc ran with its small-chunk caches, whose peaks grew with a share's samples
# and varied from run to run. As swarm runs glibc now (swarm.host.malloc: no tcache; the
# heap was then in huge pages, where the kernel had them), one process above its settled
# start, the most of two runs (bench/RESULTS.md, 2026-11-30 "glibc's slack fitted again"): yolov2-16 at 416
# keeping every map 196, 427 and 868 MiB for 1, 2 and 4 samples, remaking 163, 323 and 663;
# darknet53 at 256 166, 307, 593 and 134, 227, 403; yolov2-16 at 320 as a whole-model share
# 249 and 520 for 2 and 4, and as pipeline stages of 1-4 micro-batches under its model at
# slack 1. The most any of them needed, with the fixed scratch below, was 1.054 (yolov2-16 at
# 416, 4 samples, the largest maps: 88 MiB blocks whose holes other sizes do not fill); 1.15
# keeps a tenth above it.
RESIDENT_SLACK = 1.15
# Fixed per device, whatever its stage holds: the kernels' scratch and weight-format copies
# of a stage's backward (40-50 MiB in the same measurements, however small the stage), and
# what a worker holds for a job besides its stages: messages in flight both ways, its share
# of the fed images, backups of other stages (a testbed device running stage 0 of a 4-stage
# pipeline peaked ~170 MiB above the same stage run in one process).
STAGE_SCRATCH_BYTES = 64 * 2**20
WORKER_BYTES = 192 * 2**20
JOB_BYTES = STAGE_SCRATCH_BYTES + WORKER_BYTES
# A device whose one stage is the whole model (dp, or a single device) has no activations in
# flight between stages and no other stage to back up (WORKER_BYTES), and the runtime its
# profile measured (after a training step of the whole model) already holds that model's
# kernel scratch (STAGE_SCRATCH_BYTES): it keeps the job's whole reserve. Measured for
# yolov2-16 at 416 on the testbed, resident with the runtime, against this model with a
# runtime of 342 MiB: 1 sample 541 MiB (model 668), 2 samples of a group's micro-batch
# 733-825 (954), 2 samples alone 840-873 (954), 4 alone on a 2 GiB device 1528-1775 (1869).
WHOLE_MODEL_RESERVE = JOB_BYTES
# The allocator's slack grew with a device's share of a micro-batch: one heap (swarm.host.
# malloc) reused the holes that a small share's maps leave, less so a large share's. Measured
# for yolov2-16 at 416 as a dp share on the testbed, resident with the runtime: 541 MiB with
# 1 sample, 733-873 with 2, 1528-1775 with 4 (the most with 5 micro-batches a step), where a
# constant slack gives 1525; in one process, 4 samples held 1.24 GB after one micro-batch
# and 1.67 GB from the third on: beyond 2 samples each sample added 0.15 to the slack. That
# growth was glibc's small-chunk caches (tcache and fastbins) keeping large freed blocks from
# merging; swarm runs glibc without them (swarm.host.malloc), and a share's peak is then
# linear in its samples and flat from the third micro-batch on: in one process, 215, 422,
# 650, 861 and 1027 MiB above the start for 1-5 samples (bench/allocator_peaks.py; before,
# 4 samples 1048-1251). So on glibc, as on jemalloc, no growth: SHARE_GROWTH is the
# mechanism, for an allocator that needs it.
SHARE_GROWTH = 0.0
GROWTH_FROM = 2
# On jemalloc (swarm.host.malloc preloads it where it is installed) large blocks come in size
# classes from extents that are reused whatever their order, and a share's peak grows by
# about its saved bytes, with no growth; the backward's buffers take the room of the saved
# tensors the later layers' backwards have freed (REUSES_FREED). Measured for yolov2-16 at
# 416 in one process above its settled start: 1, 2 and 4 samples 180, 364 and 611 MiB
# (glibc 236, 463 and 1020; this model with the stage scratch: 224, 386 and 707). On the
# testbed (1 GiB, 0.2 core) a dp device computing micro-batches of 4 samples peaked at
# 947-962 MiB in `auto` runs, whose training began at 289-293 MiB resident (after the
# profile): 658-673 MiB for the job, against this model's 683 (859-868 in runs of the plan
# alone, begun at 243).
JEMALLOC_SLACK = 1.25
JEMALLOC_GROWTH = 0.0
# glibc as swarm ran it until 2026-12 where the kernel had transparent huge pages ("glibc-thp",
# which older profiles may name) kept its heap as above, in huge pages: the same peaks, so the
# same slack; in small pages, as now, 4 samples held 798-818 MiB in a 1 GiB cgroup (bench/
# RESULTS.md, 2026-12-01). A plan may have glibc devices map their largest blocks instead
# (planner.mapping).
# Whether the backward's buffers reuse the room the saved tensors of the layers behind them
# (already back-propagated) have freed. glibc's heap, tuned by swarm.host.malloc to keep
# what it frees, does not hand that room to maps of other sizes (its peaks above grow
# with the buffers on top of everything saved); jemalloc's size classes do.
REUSES_FREED = {"glibc": False, "jemalloc": True, "glibc-thp": False}
# A device keeps, besides its working copy, a snapshot of its stages' weights and optimizer
# state to roll back to, and the state of the stage it backs up for another device
# (swarm.execution.worker). The measurements above were of yolov2-16, whose whole state is
# 26 MiB (sgd): what they found, and the reserves set from them, hold that much. A device's
# kept states beyond KEPT_IN_RESERVE are counted on top (MemoryModel.kept_charge): a stage of
# yolov3 at 416 keeps up to 470 MiB.
KEPT_IN_RESERVE = 32 * 2**20
# A remade layer whose map is STREAM_FROM elements or more a sample back-propagates its BatchNorm
# and activation a run of channels at a time, each run of STREAM_CHUNK_BYTES or so
# (swarm.zoo.recompute): its backward holds the incoming and outgoing gradients of the whole
# map, and a few maps of a run's size (in STAGE_SCRATCH_BYTES) instead of three of the
# whole map's. On one thread (x86, float32, alternating, medians) a remade layer's forward and
# backward over a 4x32x416x416 map took 0.66x the time of remaking it whole, 4x64x208x208 0.84x,
# 4x128x104x104 0.97x (smaller maps gain nothing); whole yolov2-16 passes at 416 1.047x keeping
# every map, against 1.123x (bench/stream_time.py). STREAM_FROM is 2M elements a sample (8 MiB
# in float32; yolov2-16's first two convs at 416, its first at 320).
STREAM_FROM = 2 * 2**20
STREAM_CHUNK_BYTES = 2 * 2**20
# Only piecewise-linear activations stream: their gradient is a product that rounds the same in
# any run of the map, where swish's or mish's exp rounds differently in the vectorised part of a
# run and its scalar tail (efficientnet-b0's weights came out a bit apart).
STREAMED_ACTIVATIONS = ("leaky", "relu", "relu6", "linear")
# the slack and growth of each allocator a device's profile may name; any other: glibc's
ALLOCATORS = {"glibc": (RESIDENT_SLACK, SHARE_GROWTH), "jemalloc": (JEMALLOC_SLACK, JEMALLOC_GROWTH),
              "glibc-thp": (RESIDENT_SLACK, SHARE_GROWTH)}


def plan_allocator(allocators) -> str:
    """The allocator whose slack a plan for devices running on `allocators` assumes (the
    planner's model is one for all devices): the one that holds the most among them, an
    unknown one as glibc."""
    known = {a if a in ALLOCATORS else "glibc" for a in allocators} or {"glibc"}
    return max(known, key=lambda a: (ALLOCATORS[a][0], not REUSES_FREED[a]))


def in_bytes(desc: ModelDesc, index: int) -> int:
    """Bytes per sample of everything layer `index` reads."""
    return sum(desc.input_bytes if s < 0 else desc.layers[s].out_bytes for s in desc.layers[index].inputs)


# activations whose backward reads their result (the rest — mish, swish, gelu, hard_mish — read
# their input, and their result is a new map that only its readers keep)
KEEP_RESULT = ("leaky", "relu", "relu6", "logistic", "tanh")


def results_kept(desc: ModelDesc) -> set[int]:
    """The layers whose output its producer keeps already, as its activation's result (leaky,
    ReLU and ReLU6 run in place on BatchNorm's output and keep it; sigmoid and tanh keep
    their result too), and routes that pass such an output on unchanged."""
    kept: set[int] = set()
    for layer in desc.layers:
        if layer.kind in ("conv", "connected", "shortcut", "scale_channels", "sam") and layer.activation in KEEP_RESULT:
            kept.add(layer.index)
        elif layer.kind == "route" and len(layer.inputs) == 1 and layer.inputs[0] in kept:
            kept.add(layer.index)
    return kept


def input_kept_upstream(desc: ModelDesc) -> set[int]:
    """The layers whose one input is kept already by the layer that made it (results_kept),
    so that keeping it costs them nothing more."""
    kept = results_kept(desc)
    return {layer.index for layer in desc.layers if len(layer.inputs) == 1 and layer.inputs[0] in kept}


def recomputable(desc: ModelDesc) -> frozenset[int]:
    """The layers whose BatchNorm output and activation result a backward can remake from the
    conv's output (swarm.zoo.recompute): conv and connected layers with BatchNorm."""
    return frozenset(layer.index for layer in desc.layers if layer.kind in ("conv", "connected") and layer.batch_normalize)


def streamed(desc: ModelDesc, remade: frozenset[int]) -> frozenset[int]:
    """The remade layers whose backward runs a few channels at a time: maps of STREAM_FROM
    elements or more a sample, with an activation of STREAMED_ACTIVATIONS."""
    return frozenset(i for i in remade if desc.layers[i].out_bytes / BYTES_PER_FLOAT >= STREAM_FROM
                     and desc.layers[i].activation in STREAMED_ACTIVATIONS)


def remade_maps(desc: ModelDesc, remade: frozenset[int]) -> set[int]:
    """The layers whose output is, to every layer reading it, a recipe rather than a kept map:
    the remade layers, and routes that pass one remade map on (the same tensor, or a group of
    its channels: a view of it)."""
    maps: set[int] = set()
    for layer in desc.layers:
        if layer.index in remade:
            maps.add(layer.index)
        elif layer.kind == "route" and len(layer.inputs) == 1 and layer.inputs[0] in maps:
            maps.add(layer.index)
    return maps


def estimate_activation_bytes(desc: ModelDesc, remade: frozenset[int] = frozenset()) -> list[int]:
    """Per-sample bytes each layer keeps for its backward, as torch does for the zoo's layers:
    a conv keeps its input (unless its producer keeps it: input_kept_upstream), BatchNorm its
    input, the activation its result; max pooling a byte per output (the selected position
    in its window); average pooling, route, reorg, upsample, crop and the heads only rearrange or pass maps on,
    and a shortcut only adds (nothing kept, but an activation's); scale_channels and sam
    multiply, keeping both factors. A layer in `remade` keeps only its conv's output (BatchNorm's
    input): its BatchNorm output and activation result, and any layer's copy of them, are
    recipes (swarm.zoo.recompute)."""
    upstream = input_kept_upstream(desc)
    recipes = remade_maps(desc, remade)

    def read(index: int) -> int:  # what keeping the layer's inputs costs
        return sum(0 if s in recipes else (desc.input_bytes if s < 0 else desc.layers[s].out_bytes)
                   for s in desc.layers[index].inputs)

    out = []
    for layer in desc.layers:
        ob = layer.out_bytes
        if layer.kind in ("route", "reorg", "upsample", "crop", "yolo", "avgpool"):  # (averaging needs only the shape)
            out.append(0)
        elif layer.kind == "shortcut":
            out.append(ob if layer.activation != "linear" else 0)
        elif layer.kind in ("scale_channels", "sam"):
            out.append(read(layer.index) + (ob if layer.activation != "linear" else 0))
        elif layer.kind == "maxpool":
            out.append(ob // BYTES_PER_FLOAT if layer.kernel * layer.kernel <= 256 else 2 * ob)
        elif layer.index in remade:
            out.append((0 if layer.index in upstream else read(layer.index)) + ob)
        elif layer.kind in ("conv", "connected"):
            keep = 0 if layer.index in upstream else read(layer.index)
            keep += ob if layer.batch_normalize else 0
            keep += ob if layer.activation != "linear" else 0
            out.append(keep)
        elif layer.kind == "dropout":
            out.append(ob)  # the mask, in the map's own type (swarm.zoo.net multiplies by it)
        else:  # avgpool and anything local: keeps its input
            out.append(0 if layer.index in upstream else read(layer.index))
    return out


@dataclass
class MemoryModel:
    """What memory a model's stages need: per-layer parameters and saved activations."""

    desc: ModelDesc
    act_bytes: np.ndarray  # (layers,) bytes kept per sample for the backward
    optimizer: str = "sgd"
    measured: bool = False  # act_bytes come from a profile rather than the estimate
    slack: float = 1.0  # resident bytes per byte of activations and gradients (RESIDENT_SLACK on devices)
    whole_reserve: float = 0.0  # bytes a device's budget gains for a stage of the whole model (on devices:
    #                              WHOLE_MODEL_RESERVE, the job's reserve, which such a stage leaves unused)
    growth: float = 0.0  # the slack's growth per sample of a share beyond GROWTH_FROM (SHARE_GROWTH on devices)
    reuse: bool = True  # the backward's buffers take the room of the saved tensors already freed (REUSES_FREED)
    kept: bool = False  # a device also keeps a copy of its stages' weights and optimizer state to roll back to
    #                     (for_devices: the runtime's rollback, swarm.execution.worker), and the stage
    #                     it backs up for another device (planner.simulator)
    remade: frozenset[int] = frozenset()  # layers whose BatchNorm output and activation result the backward
    #                                       remakes (recomputing); act_bytes are then what they keep so
    checkpointed = False  # (not a field) stages run in checkpointed segments: planner.checkpoint.CheckpointingModel

    def __post_init__(self):
        self.act_bytes = np.asarray(self.act_bytes, dtype=float)
        if self.act_bytes.shape != (len(self.desc.layers),):
            raise ValueError(f"activation bytes for {self.act_bytes.shape[0]} layers, the model has {len(self.desc.layers)}")
        if self.optimizer not in OPTIMIZER_STATE_FLOATS:
            raise ValueError(f"unknown optimizer '{self.optimizer}'; known: {', '.join(OPTIMIZER_STATE_FLOATS)}")
        self.param_bytes = np.array([layer.param_bytes for layer in self.desc.layers], dtype=float)
        self.out_bytes = np.array([layer.out_bytes for layer in self.desc.layers], dtype=float)
        self.in_bytes = np.array([in_bytes(self.desc, i) for i in range(len(self.desc.layers))], dtype=float)
        # a layer's backward holds the gradient of its output and of its input, and one more
        # map of its output's size for each pointwise step it runs (BatchNorm, activation)
        # (a remade layer's backward also holds the map it remade, but one that streams holds only
        # its outgoing gradient beside the incoming one)
        streams = streamed(self.desc, self.remade)
        pointwise = [1 if layer.index in streams else
                     int(layer.batch_normalize) + int(layer.activation != "linear") + int(layer.index in self.remade)
                     if layer.kind in ("conv", "connected") else 0 for layer in self.desc.layers]
        self.grad_bytes = self.out_bytes * (1 + np.array(pointwise, dtype=float)) + self.in_bytes
        self._cum_params = np.concatenate([[0.0], np.cumsum(self.param_bytes)])
        self._cum_act = np.concatenate([[0.0], np.cumsum(self.act_bytes)])
        self._boundary = np.array([self.desc.boundary_bytes(b) for b in range(len(self.desc.layers) + 1)], dtype=float)
        self.transient_table = self._transients()

    def _transients(self) -> np.ndarray:
        """(layers + 1, layers + 1): per sample, what a backward over layers [first, last)
        holds at its worst layer beyond the micro-batch's saved tensors. Each layer's buffers
        (grad_bytes) are alive while it back-propagates; by then the layers after it have
        freed what they saved, room the buffers take where the allocator reuses it (reuse),
        so beyond the saved tensors they need max over k of grad_bytes[k] less what layers
        (k, last) saved, and at least nothing. Without reuse: the largest buffers."""
        n = len(self.desc.layers)
        table = np.zeros((n + 1, n + 1))
        # a layer's buffers plus what the layers up to it keep, against the range's total
        lead = self.grad_bytes + self._cum_act[1:] if self.reuse else self.grad_bytes
        for first in range(n):
            top = np.maximum.accumulate(lead[first:])  # over k in [first, last), last = first + 1 ...
            table[first, first + 1:] = np.maximum(top - self._cum_act[first + 1:], 0.0) if self.reuse else top
        return table

    @classmethod
    def estimated(cls, desc: ModelDesc, optimizer: str = "sgd") -> "MemoryModel":
        return cls(desc, estimate_activation_bytes(desc), optimizer)

    @classmethod
    def for_devices(cls, desc: ModelDesc, optimizer: str = "sgd", act_bytes=None,
                    allocator: str = "glibc") -> "MemoryModel":
        """The model for planning real devices: measured saved bytes when given, the slack of
        the devices' allocator (plan_allocator) on activations and gradients, and the reserve
        a whole-model stage keeps."""
        known = allocator if allocator in ALLOCATORS else "glibc"
        slack, growth = ALLOCATORS[known]
        held = dict(slack=slack, whole_reserve=WHOLE_MODEL_RESERVE, growth=growth, reuse=REUSES_FREED[known],
                    kept=True)
        if act_bytes is None:
            return cls(desc, estimate_activation_bytes(desc), optimizer, **held)
        return cls(desc, act_bytes, optimizer, measured=True, **held)

    def recomputing(self) -> "MemoryModel":
        """This model for a backward that remakes every BatchNorm output and activation result
        (swarm.zoo.recompute): each such layer keeps only its conv's output. Measured bytes
        lose what the estimate says the recipes save, layer by layer."""
        if self.checkpointed:
            raise ValueError("a stage remakes BatchNorm or checkpoints its segments, not both")
        remade = recomputable(self.desc)
        if self.remade == remade:
            return self
        saving = np.array(estimate_activation_bytes(self.desc)) - np.array(estimate_activation_bytes(self.desc, remade))
        act = np.maximum(self.act_bytes - saving, 0.0)
        return replace(self, act_bytes=act, remade=remade)

    def budget(self, first: int, last: int, memory: float) -> float:
        """What a device with budget `memory` (its memory less the runtime and JOB_BYTES) may
        spend on a stage of layers [first, last): more for a stage of the whole model."""
        return memory + (self.whole_reserve if first == 0 and last == len(self.desc.layers) else 0.0)

    # ---- per stage -------------------------------------------------------------------
    def weights(self, first: int, last: int) -> float:
        """Mem(MOD) + Mem(OPT): parameters, their gradients, and the optimizer's state; with
        `kept`, also the snapshot of the parameters and state that a device rolls back to
        (kept_charge: the part beyond the reserves)."""
        per_param_copies = 2 + OPTIMIZER_STATE_FLOATS[self.optimizer]
        return per_param_copies * (self._cum_params[last] - self._cum_params[first]) + self.kept_charge(self.state(first, last))

    def kept_charge(self, kept: float) -> float:
        """What a device keeping `kept` bytes (or an array of them) of snapshots and backups
        needs for them beyond the reserves (KEPT_IN_RESERVE); nothing for the papers' model
        (kept False)."""
        if not self.kept:
            return 0.0 * kept
        charge = np.maximum(np.asarray(kept, dtype=float) - KEPT_IN_RESERVE, 0.0)
        return float(charge) if charge.ndim == 0 else charge

    @property
    def state_copies(self) -> int:
        """Floats per parameter of a stage's state as a snapshot or a backup holds it: the
        parameter and the optimizer's state, not its gradient."""
        return 1 + OPTIMIZER_STATE_FLOATS[self.optimizer]

    def state(self, first: int, last: int) -> float:
        """Bytes of a snapshot or backup of layers [first, last)."""
        return self.state_copies * (self._cum_params[last] - self._cum_params[first])

    def share_factor(self, batch: float) -> float:
        """How much more than `slack` a share of `batch` samples holds per byte (SHARE_GROWTH)."""
        return 1.0 + self.growth * max(0.0, batch - GROWTH_FROM)

    def activations(self, first: int, last: int, batch: float) -> float:
        """Mem(ACT)(beta): what one micro-batch of `batch` samples keeps until its backward."""
        return batch * (self.slack * self.share_factor(batch) * (self._cum_act[last] - self._cum_act[first]))

    def transient(self, first: int, last: int, batch: float) -> float:
        """What one micro-batch's backward holds beyond its saved tensors, at its worst layer
        (_transients): each layer's buffers are the gradients of its output, of each
        pointwise step and of its input (the outgoing gradient, until it is sent)."""
        if last <= first:
            return 0.0
        return batch * (self.slack * self.share_factor(batch) * float(self.transient_table[first, last]))

    def buffers(self, first: int, last: int, batch: float) -> float:
        """The largest one layer's backward buffers of a micro-batch, with nothing freed
        before them: an upper bound of transient, for a guard that must not underestimate."""
        if last <= first:
            return 0.0
        return batch * (self.slack * self.share_factor(batch) * float(self.grad_bytes[first:last].max()))

    def boundary(self, b: int) -> float:
        """Bytes per sample crossing a cut before layer b (forward activations; the
        backward sends gradients of the same size the other way)."""
        return float(self._boundary[b])

    def stage(self, first: int, last: int, batch: float, warmup: int) -> float:
        """Asteroid eq. 3 plus the transient buffers: the peak of one stage on one device."""
        if batch <= 0:
            return self.weights(first, last)
        return self.weights(first, last) + warmup * self.activations(first, last, batch) + self.transient(first, last, batch)

    def max_batch(self, first: int, last: int, warmup: int, budget: float) -> int:
        """The largest micro-batch share that fits a device with `budget` bytes (0 when even
        one sample does not)."""
        free = self.budget(first, last, budget) - self.weights(first, last)
        per_sample = warmup * self.activations(first, last, 1) + self.transient(first, last, 1)
        return max(0, int(largest_share(free, per_sample, self.growth)))


def largest_share(free, per_sample, growth: float):
    """The most samples b with b * per_sample * (1 + growth * max(0, b - GROWTH_FROM)) <= free
    (MemoryModel.stage less the weights), elementwise over arrays: -1 where free < 0 (not
    even the weights fit), 1 << 30 where a sample costs nothing."""
    free, per = np.asarray(free, dtype=float), np.asarray(per_sample, dtype=float)
    safe = np.where(per > 0, per, 1.0)
    linear = np.floor(np.maximum(free, 0.0) / safe)
    if growth > 0:  # beyond GROWTH_FROM: the root of g p b^2 + (1 - g F) p b - free = 0
        a, b = growth, 1.0 - growth * GROWTH_FROM
        root = np.floor((-b + np.sqrt(b * b + 4 * a * np.maximum(free, 0.0) / safe)) / (2 * a) + 1e-9)
        linear = np.where(linear > GROWTH_FROM, np.maximum(GROWTH_FROM, root), linear)
    cap = np.where(per > 0, np.minimum(linear, float(1 << 30)), float(1 << 30))
    return np.where(free < 0, -1.0, cap)
