"""The per-layer description of a network that planners, cost models and pictures read.

It is plain data: the model zoo produces it from a darknet .cfg, and nothing in
here knows about torch modules, sockets or devices.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from planner.image_size import ImageSize

BYTES_PER_FLOAT = 4  # activations, gradients and weights travel and live as float32
HEAD_READ = 1 << 62  # ModelDesc._last_read of a head: the loss reads it after every layer


@dataclass(frozen=True)
class LayerDesc:
    """One layer of a network, for one sample at one input size."""

    index: int
    kind: str  # conv | maxpool | avgpool | route | reorg | connected | dropout | shortcut | upsample |
    #            scale_channels | sam | crop | yolo  (what each computes: swarm/zoo/build.py)
    in_shape: tuple[int, int, int]  # (C, H, W) of the (first) input
    out_shape: tuple[int, int, int]  # (C, H, W); (N, 1, 1) for a connected layer
    inputs: tuple[int, ...]  # indices of the layers whose outputs this one reads; -1 = the image
    kernel: int = 1
    stride: int = 1
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # (left, right, top, bottom)
    batch_normalize: bool = False
    activation: str = "linear"
    params: int = 0  # trainable parameters (BN buffers not counted)
    flops: int = 0  # forward floating-point operations per sample (a multiply-add is 2)
    groups: int = 1  # conv: channel groups (depthwise: = in channels); route: the inputs' channels in this many parts
    group_id: int = 0  # route: which part of each input it takes
    dilation: int = 1  # conv
    stride_x: int = 0  # conv, maxpool: the column stride where it differs from the row stride (`stride`); 0: the same

    @property
    def param_bytes(self) -> int:
        return self.params * BYTES_PER_FLOAT

    @property
    def out_bytes(self) -> int:
        """Bytes of this layer's output activation, per sample."""
        c, h, w = self.out_shape
        return c * h * w * BYTES_PER_FLOAT

    @property
    def backward_flops(self) -> int:
        """Backward FLOPs per sample: input gradient plus weight gradient (about 2x forward
        for layers with weights, 1x for the rest)."""
        return 2 * self.flops if self.params else self.flops

    @property
    def spatial(self) -> bool:
        """True for the layers that tiling can split: local windows over an (H, W) map."""
        return (self.kind in ("conv", "maxpool", "avgpool") and self.kernel > 0 and self.groups == 1
                and self.dilation == 1 and self.stride_x in (0, self.stride))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(param_bytes=self.param_bytes, out_bytes=self.out_bytes)
        return d


@dataclass(frozen=True)
class ModelDesc:
    """A whole network: its layers in execution order, the input it takes, and its loss."""

    name: str
    img_size: ImageSize  # width x height; the maps are (C, H, W)
    in_channels: int
    layers: tuple[LayerDesc, ...]
    loss: str  # "region" (YOLOv2), "yolo" (YOLOv3 heads), "detection" (YOLOv1) or "softmax" (classification)
    extra: dict = field(default_factory=dict)  # loss parameters (anchors, classes, ...)
    outputs: tuple[int, ...] = ()  # the layers the loss reads, in head order (default: the last layer)

    def __post_init__(self) -> None:
        object.__setattr__(self, "img_size", ImageSize.of(self.img_size))  # an int is a square
        if not self.outputs and self.layers:
            object.__setattr__(self, "outputs", (len(self.layers) - 1,))

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def flops(self) -> int:
        return sum(layer.flops for layer in self.layers)

    @property
    def input_bytes(self) -> int:
        return self.in_channels * self.img_size.pixels * BYTES_PER_FLOAT

    @property
    def detects(self) -> bool:
        """Whether the network finds boxes (its targets are boxes, not one class a sample)."""
        return self.loss in ("region", "yolo", "detection")

    def head_of(self, outs: dict):
        """What the loss takes from a forward's outputs (by layer index): the output tensor of
        a one-head network, a list of them (in head order) for several heads."""
        if len(self.outputs) == 1:
            return outs[self.outputs[0]]
        return [outs[i] for i in self.outputs]

    def live_after(self, boundary: int) -> tuple[int, ...]:
        """Layers whose outputs must cross a cut placed before layer `boundary`:
        produced before it (or the image, -1) and read at or after it. The loss reads its
        heads after the last layer, so a head computed early travels to the end with the
        maps (`live_after(len(self))` is `outputs`)."""
        last_read = self._last_read()
        return tuple(src for src in range(-1, min(boundary, len(self.layers))) if last_read[src + 1] >= boundary)

    def boundary_bytes(self, boundary: int) -> int:
        """Bytes per sample that cross a cut before layer `boundary`."""
        table = self.memo("boundary_bytes", self._boundary_table)  # the planners ask for each cut many times
        return table[boundary] if 0 <= boundary <= len(self.layers) else sum(
            self.input_bytes if src < 0 else self.layers[src].out_bytes for src in self.live_after(boundary))

    def _boundary_table(self) -> list[int]:
        """boundary_bytes of every cut 0..len, each map counted at the cuts it crosses."""
        last_read, size = self._last_read(), len(self.layers)
        diff = [0] * (size + 2)
        for src in range(-1, size):
            if last_read[src + 1] > src:  # live at the cuts src+1 .. its last reader
                size_of = self.input_bytes if src < 0 else self.layers[src].out_bytes
                diff[src + 1] += size_of
                diff[min(last_read[src + 1], size) + 1] -= size_of
        table, total = [], 0
        for b in range(size + 1):
            total += diff[b]
            table.append(total)
        return table

    def _last_read(self) -> list[int]:
        """For the image and each layer (index + 1): the last layer that reads its output,
        HEAD_READ for a head (the loss reads it after every layer), or -2 if nothing does."""
        def make() -> list[int]:
            last_read = [-2] * (len(self.layers) + 1)
            for j, layer in enumerate(self.layers):
                for src in layer.inputs:
                    last_read[src + 1] = max(last_read[src + 1], j)
            for i in self.outputs:
                last_read[i + 1] = HEAD_READ
            return last_read
        return self.memo("last_read", make)

    def memo(self, key: str, make):
        """make(), computed once per description and kept with it: a description never
        changes (frozen), and what is derived from its layers alone may be kept (not a field:
        equality, copies and JSON see only the layers)."""
        cache = self.__dict__.setdefault("_memo", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "img_size": self.img_size.to_json(),
            "in_channels": self.in_channels,
            "loss": self.loss,
            "layers": [layer.to_dict() for layer in self.layers],
        }
