"""The torch arithmetic of one layer on one tile's region: window ops, BatchNorm from global sums, activations.

Each function is the exact formula torch uses untiled, applied to a rectangle of the map
whose border padding (zeros for convolution, -inf for darknet's max-pool) is added only
where the rectangle reaches the real edge of the map.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tiles.regions import Padding, Rect, TilingError


def crop(t: torch.Tensor, origin: Rect, want: Rect) -> torch.Tensor:
    """The `want` part of tensor t (B, C, h, w) that holds `origin` (a view)."""
    rows, cols = want.relative_to(origin)
    return t[:, :, rows, cols]


def pad(x: torch.Tensor, padding: Padding, value: float) -> torch.Tensor:
    return F.pad(x, padding.as_lrtb(), value=value) if padding.any else x


def assemble(shape_bc: tuple[int, int], rect: Rect, parts: list[tuple[Rect, torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """A (B, C, rect) tensor filled from (rect, tensor) parts that tile it."""
    out = like.new_empty((*shape_bc, *rect.shape))  # (B, C, h, w)
    for r, t in parts:
        if not r.empty:
            rows, cols = r.relative_to(rect)
            out[:, :, rows, cols] = t
    return out


# ---- BatchNorm with statistics over all tiles ---------------------------------------------
# A tile may run several micro-batches as one block (`splits`: samples per micro-batch, in
# order); each micro-batch keeps its own statistics, as if it had run alone. Sums are
# therefore (G, 2, C), one row per micro-batch, and per-micro-batch (G, C) values are spread
# over the block's samples with `Spread`.
class Spread:
    """Per-micro-batch rows (G, C) -> a tensor that broadcasts over a (B, C, h, w) block."""

    def __init__(self, splits: tuple[int, ...], device: torch.device | None = None):
        self.splits = tuple(splits)
        self.device = device  # where the block's maps are (None: the CPU)
        self.owner = None if len(self.splits) == 1 else \
            torch.repeat_interleave(torch.arange(len(self.splits), device=device),
                                    torch.tensor(self.splits, device=device))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.owner is None:
            return rows.reshape(1, -1, 1, 1)
        return rows.index_select(0, self.owner).view(len(self.owner), -1, 1, 1)

    def parts(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """t (B, ...) cut into the micro-batches."""
        return (t,) if self.owner is None else torch.split(t, self.splits)

    def counts(self, pixels: int) -> torch.Tensor:
        """(G, 1) float64: values each micro-batch's statistics are taken over."""
        return torch.tensor([[s * pixels] for s in self.splits], dtype=torch.float64, device=self.device)


def forward_sums(z_own: torch.Tensor) -> torch.Tensor:
    """(2, C) float64 [sum z, sum z^2] over owned pixels, from the local mean and biased
    variance that torch's own BatchNorm statistics kernel computes (two passes over z, no
    normalised output made: the squares lose no precision)."""
    n = z_own.shape[0] * z_own.shape[2] * z_own.shape[3]
    mean, var = torch.batch_norm_update_stats(z_own, None, None, 0.0)
    mean = mean.double()
    var = var.double()
    return torch.stack([mean * n, var * n + mean * mean * n])  # (2, C)


def batch_stats(sums: torch.Tensor, count, eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased var, 1/sqrt(var + eps)) in `dtype` from global sums (..., 2, C) taken
    over `count` values (a number, or (..., 1) per row); each result is (..., C)."""
    mean = sums[..., 0, :] / count
    var = (sums[..., 1, :] / count - mean * mean).clamp(min=0.0)
    invstd = 1.0 / torch.sqrt(var + eps)
    return mean.to(dtype), var.to(dtype), invstd.to(dtype)


def update_running_stats(bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    """What BatchNorm2d does in training mode: running_var takes the unbiased variance."""
    if not bn.track_running_stats:
        return
    bn.num_batches_tracked.add_(1)
    momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
    unbiased = var * (count / max(1, count - 1))
    bn.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
    bn.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def bn_scale_shift(bn: nn.BatchNorm2d, invstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha (..., C), beta (1, C, 1, 1)) with bn(z) = (z - mean) * alpha + beta."""
    alpha = invstd * bn.weight.detach() if bn.affine else invstd
    beta = bn.bias.detach() if bn.affine else invstd.new_zeros(1)
    return alpha, beta.view(1, -1, 1, 1)


def backward_sums(du_own: torch.Tensor, zc_own: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """(2, C) float64 [sum g, sum g * xhat] over owned pixels (also d beta and d gamma), with
    xhat = zc * invstd and zc = z - mean: torch's BatchNorm backward reduction, in one pass
    and without the input gradient (which needs the sums over all tiles). The weight is ones:
    the two sums do not depend on it, but CUDA's kernel shapes its outputs after it."""
    zero = invstd.new_zeros(invstd.shape)
    ones = invstd.new_ones(invstd.shape)
    _, s_gx, s_g = torch.ops.aten.native_batch_norm_backward(du_own, zc_own, ones, None, None, zero, invstd, True,
                                                              0.0, [False, True, True])
    return torch.stack([s_g.double(), s_gx.double()])


def bn_input_grad(du: torch.Tensor, zc: torch.Tensor, sums: torch.Tensor, count, invstd: torch.Tensor,
                  gamma: torch.Tensor | None, spread: Spread) -> torch.Tensor:
    """dL/dz = gamma * invstd * (du - mean(du) - xhat * mean(du * xhat)), means over each
    micro-batch's whole map (sums (G, 2, C), count (G, 1), invstd (G, C)), with xhat = zc *
    invstd: written as a * du + b * zc + c per channel, two passes over the map."""
    mean_du = (sums[:, 0] / count).to(du.dtype)
    mean_dux = (sums[:, 1] / count).to(du.dtype)
    a = invstd if gamma is None else invstd * gamma.detach()  # (G, C)
    b = -a * invstd * mean_dux
    c = -a * mean_du
    return torch.addcmul(spread(c), zc, spread(b)).addcmul_(du, spread(a))


# ---- activations ------------------------------------------------------------------------------
class HardMish(nn.Module):
    """darknet's hard_mish: x for x > 0, x * (x / 2 + 1) for -2 < x <= 0, else 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x, x * (x / 2 + 1).clamp(min=0.0))


def _hard_mish_grad(u: torch.Tensor) -> torch.Tensor:
    return torch.where(u > 0, torch.ones_like(u), (u + 1) * (u > -2))


# the smooth activations of later darknet networks: (forward, backward from the input), by torch's own formulas
_SMOOTH = {
    nn.Mish: (lambda act, u: F.mish(u), lambda act, dy, u: torch.ops.aten.mish_backward(dy, u)),
    nn.SiLU: (lambda act, u: F.silu(u), lambda act, dy, u: torch.ops.aten.silu_backward(dy, u)),
    nn.GELU: (lambda act, u: F.gelu(u, approximate=act.approximate),
              lambda act, dy, u: torch.ops.aten.gelu_backward(dy, u, approximate=act.approximate)),
    nn.Hardtanh: (lambda act, u: F.hardtanh(u, act.min_val, act.max_val),  # ReLU6 is one
                  lambda act, dy, u: torch.ops.aten.hardtanh_backward(dy, u, act.min_val, act.max_val)),
    HardMish: (lambda act, u: act(u), lambda act, dy, u: dy * _hard_mish_grad(u)),
}


def _smooth(act: nn.Module):
    return next((ops for kind, ops in _SMOOTH.items() if isinstance(act, kind)), None)


def activation_forward(act: nn.Module, u: torch.Tensor, inplace: bool) -> torch.Tensor:
    if isinstance(act, nn.Identity):
        return u
    smooth = _smooth(act)
    if smooth is not None:  # never in place: the backward reads u
        return smooth[0](act, u)
    if isinstance(act, nn.LeakyReLU):
        return F.leaky_relu_(u, act.negative_slope) if inplace else F.leaky_relu(u, act.negative_slope)
    if isinstance(act, nn.ReLU):
        return F.relu_(u) if inplace else F.relu(u)
    if isinstance(act, nn.Sigmoid):
        return u.sigmoid_() if inplace else torch.sigmoid(u)
    if isinstance(act, nn.Tanh):
        return u.tanh_() if inplace else torch.tanh(u)
    raise TilingError(f"activation {type(act).__name__} is not supported in a tiles stage")


def activation_backward(act: nn.Module, u: torch.Tensor, dy: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """dL/du from dL/dy, with u the activation's input (torch's own backward formulas);
    written over u if `overwrite` (u is not needed afterwards)."""
    if isinstance(act, nn.Identity):
        return dy
    smooth = _smooth(act)
    if smooth is not None:
        return smooth[1](act, dy, u)
    out = {"grad_input": u} if overwrite else {}
    if isinstance(act, nn.LeakyReLU):
        op = torch.ops.aten.leaky_relu_backward
        return op.grad_input(dy, u, act.negative_slope, False, **out) if out else op(dy, u, act.negative_slope, False)
    if isinstance(act, nn.ReLU):
        op = torch.ops.aten.threshold_backward
        return op.grad_input(dy, u, 0.0, **out) if out else op(dy, u, 0.0)
    if isinstance(act, nn.Sigmoid):
        y = u.sigmoid_() if overwrite else torch.sigmoid(u)
        op = torch.ops.aten.sigmoid_backward
        return op.grad_input(dy, y, grad_input=y) if overwrite else op(dy, y)
    if isinstance(act, nn.Tanh):
        y = u.tanh_() if overwrite else torch.tanh(u)
        op = torch.ops.aten.tanh_backward
        return op.grad_input(dy, y, grad_input=y) if overwrite else op(dy, y)
    raise TilingError(f"activation {type(act).__name__} is not supported in a tiles stage")


# ---- window ops -------------------------------------------------------------------------------
def conv_input_grad(dz: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """Gradient over the (padded) input extent read by the outputs in dz: (B, Cin, he, we)."""
    k_h, k_w = weight.shape[2:]
    extent = ((dz.shape[2] - 1) * stride + k_h, (dz.shape[3] - 1) * stride + k_w)
    shape_only = dz.new_empty((dz.shape[0], weight.shape[1], *extent))  # convolution_backward reads only its shape
    return torch.ops.aten.convolution_backward(dz, shape_only, weight.detach(), None, [stride, stride], [0, 0],
                                               [1, 1], False, [0, 0], 1, [True, False, False])[0]


def conv_weight_grad(xp: torch.Tensor, dz: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """Partial weight gradient from outputs dz over their (padded) input windows xp."""
    return torch.ops.aten.convolution_backward(dz, xp, weight.detach(), None, [stride, stride], [0, 0], [1, 1],
                                               False, [0, 0], 1, [False, True, False])[1]


@functools.lru_cache(maxsize=64)
def _window_starts(oh: int, ow: int, wp: int, stride: int, device: torch.device) -> torch.Tensor:
    """(oh, ow) int64: flat index, in a padded plane of width wp, of each window's top-left input."""
    rows = torch.arange(oh, device=device) * (stride * wp)
    cols = torch.arange(ow, device=device) * stride
    return rows[:, None] + cols


@functools.lru_cache(maxsize=64)
def _code_of_offset(kernel: int, wp: int, device: torch.device) -> torch.Tensor:
    """uint8 table: flat offset dy * wp + dx inside a window -> code dy * kernel + dx."""
    table = torch.zeros((kernel - 1) * wp + kernel, dtype=torch.uint8, device=device)
    for j in range(kernel * kernel):
        r, q = divmod(j, kernel)
        table[r * wp + q] = j
    return table


@functools.lru_cache(maxsize=64)
def _offset_of_code(kernel: int, wp: int, device: torch.device) -> torch.Tensor:
    """int64 table: code dy * kernel + dx -> flat offset dy * wp + dx inside a window."""
    j = torch.arange(kernel * kernel, device=device)
    return j // kernel * wp + j % kernel


def maxpool_forward(xp: torch.Tensor, kernel: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-pool a padded region: (max values, selected position in each window as a uint8
    code dy * kernel + dx).

    torch's own kernel chooses, so the selection is the untiled one: among equal values the
    first in row-major window order, a NaN over any number, and for a window of nothing but
    -inf its top-left position. Its int64 indices (into each padded plane) are turned into
    the window-relative code, a byte per output, because the selection is kept until the
    backward and sent to the tiles that route the window's gradient.

    The kernel runs on a channels-last copy of the input: torch's max-pool over the
    contiguous (B, C, H, W) layout is a scalar loop per window, several times slower than the
    channels-last one (vectorised over channels) plus the copies there and back; both pick
    the same positions."""
    wp = xp.shape[3]
    y, idx = max_pool_channels_last(xp, kernel, stride)
    oh, ow = y.shape[2:]
    idx.sub_(_window_starts(oh, ow, wp, stride, idx.device))  # dy * wp + dx
    return y, _code_of_offset(kernel, wp, idx.device).take(idx)


def max_pool_channels_last(x: torch.Tensor, kernel: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's max-pool with indices (no padding, floor mode) on (B, C, H, W) x, computed in
    the channels-last layout: the values, contiguous (B, C, oh, ow), and the flat index into
    each input plane of every selected position (B, C, oh, ow), left channels-last."""
    y, idx = torch.ops.aten.max_pool2d_with_indices(x.contiguous(memory_format=torch.channels_last),
                                                    [kernel, kernel], [stride, stride], [0, 0], [1, 1], False)
    return y.contiguous(), idx


def maxpool_input_grad(dy: torch.Tensor, code: torch.Tensor, kernel: int, stride: int,
                       padded_shape: tuple[int, int]) -> torch.Tensor:
    """Scatter dy (B, C, oh, ow) to the selected inputs of the padded input region it was
    pooled from (whose window (0, 0) starts at its corner): (B, C, hp, wp).

    The codes become torch's flat indices again, for torch's own backward kernel, which
    adds up what overlapping windows (stride < kernel) send to one input. That kernel reads
    only the input's shape, so the input passed is a zero-stride expansion of one element."""
    b, c, oh, ow = dy.shape
    hp, wp = padded_shape
    idx = _offset_of_code(kernel, wp, code.device).take(code.long())
    idx.add_(_window_starts(oh, ow, wp, stride, code.device))
    shape_only = dy.new_empty(()).expand(b, c, hp, wp)
    return torch.ops.aten.max_pool2d_with_indices_backward(dy, shape_only, [kernel, kernel], [stride, stride],
                                                           [0, 0], [1, 1], False, idx)


def avgpool_input_grad(dy: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    b, c, h, w = dy.shape
    ones = dy.new_full((1, 1, kernel, kernel), 1.0 / (kernel * kernel))
    return F.conv_transpose2d(dy.reshape(b * c, 1, h, w), ones, stride=stride).view(b, c, *(
        ((h - 1) * stride + kernel, (w - 1) * stride + kernel)))
