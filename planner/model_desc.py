"""The per-layer description of a network that planners, cost models and pictures read.

It is plain data: the model zoo produces it from a darknet .cfg, and nothing in
here knows about torch modules, sockets or devices.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from planner.image_size import ImageSize

BYTES_PER_FLOAT = 4  # activations, gradients and weights travel and live as float32


@dataclass(frozen=True)
class LayerDesc:
    """One layer of a network, for one sample at one input size."""

    index: int
    kind: str  # conv | maxpool | avgpool | route | reorg | connected | dropout
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
        return self.kind in ("conv", "maxpool", "avgpool") and self.kernel > 0

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
    loss: str  # "region" (detection) or "softmax" (classification)
    extra: dict = field(default_factory=dict)  # loss parameters (anchors, classes, ...)

    def __post_init__(self) -> None:
        object.__setattr__(self, "img_size", ImageSize.of(self.img_size))  # an int is a square

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

    def live_after(self, boundary: int) -> tuple[int, ...]:
        """Layers whose outputs must cross a cut placed before layer `boundary`:
        produced before it (or the image, -1) and read at or after it."""
        live = set()
        for layer in self.layers[boundary:]:
            for src in layer.inputs:
                if src < boundary:
                    live.add(src)
        return tuple(sorted(live))

    def boundary_bytes(self, boundary: int) -> int:
        """Bytes per sample that cross a cut before layer `boundary`."""
        total = 0
        for src in self.live_after(boundary):
            total += self.input_bytes if src < 0 else self.layers[src].out_bytes
        return total

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "img_size": self.img_size.to_json(),
            "in_channels": self.in_channels,
            "loss": self.loss,
            "layers": [layer.to_dict() for layer in self.layers],
        }
