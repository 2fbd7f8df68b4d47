"""Torch layers the zoo needs beyond torch's own."""
from __future__ import annotations

import torch
from torch import nn

from tiles.ops import max_pool_channels_last, maxpool_forward, maxpool_input_grad


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
