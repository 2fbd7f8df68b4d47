"""Torch layers the zoo needs beyond torch's own."""
from __future__ import annotations

import torch
from torch import nn

from swarm.zoo.recompute import active as active_recipes
from swarm.zoo.recompute import run_recomputed
from tiles.ops import HardMish, max_pool_channels_last, maxpool_forward, maxpool_input_grad


class Reorg(nn.Module):
    """Space-to-depth in pixel_unshuffle's channel order (channel c*s*s + i*s + j takes row
    offset i, column offset j of channel c), also for an empty batch."""

    def __init__(self, stride: int):
        super().__init__()
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape  # (B, C, H, W) -> (B, C*s*s, H/s, W/s)
        s = self.stride
        return x.reshape(b, c, h // s, s, w // s, s).permute(0, 1, 3, 5, 2, 4).reshape(b, c * s * s, h // s, w // s)


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d that runs torch's kernel on a channels-last copy of its input.

    torch's max-pool over the contiguous (B, C, H, W) layout is a scalar loop per window; the
    channels-last kernel is vectorised over channels and, with the copies there and back,
    several times faster on the large early maps. It selects the same positions (ties go to
    the first in window order, NaN wins), so values and gradients are the ones
    nn.MaxPool2d gives. Padding, dilation, ceil mode and returned indices take torch's path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = x.dim() == 4 and self.padding in (0, (0, 0)) and self.dilation in (1, (1, 1)) \
            and not self.ceil_mode and not self.return_indices
        if not plain:
            return super().forward(x)
        kernel, stride = _single(self.kernel_size), _single(self.stride or self.kernel_size)
        if kernel is None or stride is None:
            return super().forward(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _MaxPoolChannelsLast.apply(x, kernel, stride)
        return max_pool_channels_last(x, kernel, stride)[0]


def _single(v) -> int | None:
    """The one size of a square window or stride (None for a rectangular one)."""
    if isinstance(v, int):
        return v
    return v[0] if len(set(v)) == 1 else None


class _MaxPoolChannelsLast(torch.autograd.Function):
    """Forward on the channels-last kernel; backward is torch's own, from the selected
    positions. Those are kept as a byte per output (the position inside its window, as the
    tiles keep them) rather than torch's int64 index: an eighth of the memory a max-pool
    holds until its backward, the same gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
        if kernel * kernel <= 256:
            y, code = maxpool_forward(x, kernel, stride)
        else:
            y, code = max_pool_channels_last(x, kernel, stride)
            code = code.contiguous()
        ctx.save_for_backward(code)
        ctx.shape, ctx.kernel, ctx.stride = x.shape, kernel, stride
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (code,) = ctx.saved_tensors
        k, s = ctx.kernel, ctx.stride
        if code.dtype == torch.uint8:
            return maxpool_input_grad(dy.contiguous(), code, k, s, tuple(ctx.shape[2:])), None, None
        shape_only = dy.new_empty(()).expand(ctx.shape)  # the kernel reads only the input's shape
        dx = torch.ops.aten.max_pool2d_with_indices_backward(dy.contiguous(), shape_only, [k, k], [s, s], [0, 0],
                                                             [1, 1], False, code)
        return dx, None, None


class Weighted(nn.Sequential):
    """A conv or connected layer: its weights (`conv` or `fc`), BatchNorm (`bn`) if it has one,
    and its activation (`act`). With `remade` set, a training forward under swarm.zoo.recompute's
    Recipes keeps BatchNorm's output and the activation's result as recipes."""

    remade = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.remade and self.training:
            recipes = active_recipes()
            if recipes is not None:
                return run_recomputed(self, x, recipes)
        return super().forward(x)


def activation(name: str) -> nn.Module:
    """darknet's activation by name. In place where the math allows: the activation then
    overwrites the map BatchNorm (or the conv) made, which their backward does not read, and
    keeps its result, which the next layer keeps anyway."""
    return {"leaky": lambda: nn.LeakyReLU(0.1, inplace=True), "relu": lambda: nn.ReLU(inplace=True),
            "relu6": lambda: nn.ReLU6(inplace=True), "linear": nn.Identity, "logistic": nn.Sigmoid,
            "tanh": nn.Tanh, "mish": nn.Mish, "swish": nn.SiLU, "hard_mish": HardMish,
            "gelu": lambda: nn.GELU(approximate="tanh")}[name]()


class Route(nn.Module):
    """[route]: the inputs' channels side by side; with `groups`, each input's `group_id`-th
    part of its channels (darknet's CSP blocks take half a map this way)."""

    def __init__(self, groups: int = 1, group_id: int = 0):
        super().__init__()
        self.groups, self.group_id = groups, group_id

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if self.groups > 1:
            xs = tuple(x.chunk(self.groups, dim=1)[self.group_id] for x in xs)
        return xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)


class Shortcut(nn.Module):
    """[shortcut]: the map before it plus the maps of its `from=` layers, then an activation.
    A map of another shape is added as darknet's shortcut_cpu adds it: over the channels both
    have, the larger map sampled every stride-th pixel onto the smaller (ResNet's shortcut
    without a projection: subsampled, the extra channels zero)."""

    def __init__(self, act: str):
        super().__init__()
        self.act = activation(act) if act != "linear" else None

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        y = xs[0]
        for x in xs[1:]:
            y = y + x if x.shape == y.shape else y + _placed(x, y)
        return self.act(y) if self.act is not None else y


def _placed(add: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`add` (B, C1, H1, W1) laid onto a zero map shaped like `out` (B, C2, H2, W2)."""
    (c1, h1, w1), (c2, h2, w2) = add.shape[1:], out.shape[1:]
    stride, sample = max(1, w1 // w2), max(1, w2 // w1)
    c, h, w = min(c1, c2), min(h1, h2), min(w1, w2)
    piece = add[:, :c, ::stride, ::stride][:, :, :h, :w]
    if sample == 1 and (h, w) == (h2, w2):  # channels differ only: pad them
        return torch.nn.functional.pad(piece, (0, 0, 0, 0, 0, c2 - c))
    placed = out.new_zeros(out.shape)
    placed[:, :c, ::sample, ::sample][:, :, :h, :w] = piece
    return placed


class ScaleChannels(nn.Module):
    """[scale_channels] (squeeze-and-excitation) and [sam]: the `from=` map times the map
    before it ((B, C, 1, 1) per channel, or (B, C, H, W) element by element)."""

    def __init__(self, act: str = "linear"):
        super().__init__()
        self.act = activation(act) if act != "linear" else None

    def forward(self, x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        y = source * x
        return self.act(y) if self.act is not None else y


class Upsample(nn.Module):
    """[upsample]: nearest-neighbour, each pixel repeated stride x stride times, times `scale`."""

    def __init__(self, stride: int, scale: float = 1.0):
        super().__init__()
        self.stride, self.scale = stride, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape  # (B, C, H, W) -> (B, C, H*s, W*s)
        s = self.stride
        y = x[:, :, :, None, :, None].expand(b, c, h, s, w, s).reshape(b, c, h * s, w * s)
        return y * self.scale if self.scale != 1.0 else y


class Crop(nn.Module):
    """[crop]: in training a window of the input at a place drawn for each sample (from its
    key, like dropout, so a sample is cropped alike on any device), mirrored left-right
    half of the time with `flip`; in use the window at the centre. Unless `noadjust`, darknet
    maps the input from [0, 1] to [-1, 1] here."""

    def __init__(self, out_hw: tuple[int, int], flip: bool, adjust: bool):
        super().__init__()
        self.out_hw, self.flip, self.adjust = out_hw, flip, adjust

    def forward(self, x: torch.Tensor, seeds: list[int] | None) -> torch.Tensor:
        (oh, ow), (h, w) = self.out_hw, x.shape[2:]
        if seeds is None:  # in use: the centre
            top, left = (h - oh) // 2, (w - ow) // 2
            y = x[:, :, top:top + oh, left:left + ow]
        else:
            rows = []
            for b, seed in enumerate(seeds):
                gen = torch.Generator().manual_seed(seed)
                top = int(torch.randint(h - oh + 1, (1,), generator=gen))
                left = int(torch.randint(w - ow + 1, (1,), generator=gen))
                mirror = self.flip and bool(torch.randint(2, (1,), generator=gen))
                piece = x[b:b + 1, :, top:top + oh, left:left + ow]
                rows.append(piece.flip(3) if mirror else piece)
            y = torch.cat(rows) if rows else x[:, :, :oh, :ow]
        return y * 2.0 - 1.0 if self.adjust else y
