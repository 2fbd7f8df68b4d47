"""BatchNorm and its activation recomputed in the backward instead of kept from the forward.

A conv (or connected) layer with BatchNorm keeps, for its backward, the conv's output (which
BatchNorm's backward reads) and the activation's result (which the activation's backward and
the next layer's backward read): two maps of the layer's output size, the largest term of a
stage's memory. Both are functions of the first, BatchNorm's input, and of a few numbers per
channel; recomputed, they cost a pass over the map each, and the layer keeps one map.

The network's code does not change: while a forward runs under `Recipes`, autograd's saved
tensors pass through its pack hook, and a tensor that is one of those BatchNorm or activation
outputs is kept as its recipe (the conv's output and what to do with it) instead. The
backward unpacks the recipe into a map equal bit for bit to the one the forward made: torch's
own BatchNorm kernel again on the same input (training-mode statistics are recomputed by the
same kernel; a dp group's BatchNorm gives its group statistics, see
swarm.execution.group_bn), then the layer's own activation module. So the gradients are
exactly those of the forward that kept everything.
"""
from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from planner.memory import STREAM_FROM, STREAM_CHUNK_BYTES as CHUNK_BYTES

STREAMED = (nn.LeakyReLU, nn.ReLU, nn.ReLU6, nn.Identity)  # planner.memory.STREAMED_ACTIVATIONS


class _Recipe:
    """A saved map, remade on demand. Several backward nodes may save the same map (an in-place
    activation keeps its result, which the next conv keeps as its input): they share one
    recipe, which keeps the remade map from its first unpacking to its last."""

    __slots__ = ("make", "packed", "made")

    def __init__(self, make: Callable[[], torch.Tensor]):
        self.make = make
        self.packed = 0
        self.made: torch.Tensor | None = None

    def unpack(self) -> torch.Tensor:
        made = self.made
        if made is None:
            with torch.no_grad():
                made = self.make()
        self.packed -= 1
        self.made = made if self.packed > 0 else None
        return made


def batchnorm_recipe(bn: nn.modules.batchnorm._BatchNorm, c: torch.Tensor) -> Callable[[], torch.Tensor]:
    """How to remake `bn`'s training output for input `c`: a module that says so itself (a dp
    group's BatchNorm, whose statistics span devices) through `recompute_output`, a plain one
    by its own kernel on the same input (the statistics are the batch's again; the running
    ones are left alone)."""
    own = getattr(bn, "recompute_output", None)
    remake = own(c) if own is not None else None
    if remake is not None:
        return remake
    weight, bias, eps = bn.weight, bn.bias, bn.eps
    return lambda: F.batch_norm(c, None, None, weight, bias, True, 0.0, eps)


_active: ContextVar["Recipes | None"] = ContextVar("swarm_recipes", default=None)


def active() -> "Recipes | None":
    """The recipes of the forward running in this thread, if it recomputes."""
    return _active.get()


class Recipes:
    """The saved-tensor hooks of a forward that recomputes. `note` names a map and how to remake
    it; a saved tensor that is a noted map (the same tensor, at the noted version) is packed as
    its recipe, anything else as itself. Use as a context manager around the forward."""

    def __init__(self):
        self._noted: dict[int, tuple[weakref.ref, dict[int, _Recipe]]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def note(self, t: torch.Tensor, versions: dict[int, Callable[[], torch.Tensor]]) -> None:
        """`t`, at each version in `versions` (an in-place activation moves it on by one), is
        what that function makes."""
        if t.numel():
            self._noted[t.data_ptr()] = (weakref.ref(t), {v: _Recipe(f) for v, f in versions.items()})

    def _pack(self, t: torch.Tensor):
        if t.numel():
            recipe = self._recipe(t)
            if recipe is None and t._base is not None:  # a view of a noted map (a route's group of channels)
                whole = self._recipe(t._base)
                if whole is not None:
                    size, stride, offset = t.size(), t.stride(), t.storage_offset()
                    recipe = _Recipe(lambda: whole.make().as_strided(size, stride, offset))
            if recipe is not None:
                recipe.packed += 1
                return recipe
        return t

    def _recipe(self, t: torch.Tensor) -> _Recipe | None:
        entry = self._noted.get(t.data_ptr())
        if entry is not None and entry[0]() is t:
            return entry[1].get(t._version)
        return None

    def __enter__(self) -> "Recipes":
        self._hooks.__enter__()
        self._token = _active.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.reset(self._token)
        self._noted.clear()
        self._hooks.__exit__(*exc)


def _unpack(packed):
    return packed.unpack() if isinstance(packed, _Recipe) else packed


def run_recomputed(seq: nn.Sequential, x: torch.Tensor, recipes: Recipes) -> torch.Tensor:
    """A conv or connected layer (`seq`: its weights, `bn`, `act`) whose BatchNorm output and
    activation result are noted in `recipes` to be remade from the conv's output."""
    parts = list(seq.children())
    first, bn, act = parts[0], seq.bn, seq.act
    c = first(x)
    if not (bn.training and torch.is_grad_enabled()):
        return act(bn(c))
    kept = c.detach()
    if streams(bn, act, c):
        a = _StreamedBatchNorm.apply(c, bn.weight, bn.bias, bn, act)
        norm = batchnorm_recipe(bn, kept)  # now: a dp group's statistics are this forward's
        recipes.note(a, {a._version: lambda: act(norm())})
        return a
    y = bn(c)
    norm = batchnorm_recipe(bn, kept)

    def activated() -> torch.Tensor:
        return act(norm())

    v = y._version
    recipes.note(y, {v: norm, v + 1: activated})  # at v + 1 once an in-place activation ran on it
    a = act(y)
    if a is not y:
        recipes.note(a, {a._version: activated})
    return a


def streams(bn: nn.Module, act: nn.Module, c: torch.Tensor) -> bool:
    """Whether a remade layer with BatchNorm `bn`, activation `act` and output `c` back-propagates
    a few channels at a time (planner.memory.streamed): a map of STREAM_FROM elements or more a
    sample, with samples in it, and a piecewise-linear activation."""
    return isinstance(bn, nn.modules.batchnorm._BatchNorm) and isinstance(act, STREAMED) and c.dim() >= 2 \
        and c.shape[0] > 0 and c[:1].numel() >= STREAM_FROM


class _PlainStream:
    """A plain BatchNorm's training statistics, remade from each run of channels by its own kernel."""

    def __init__(self, eps: float):
        self.eps = eps
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def weight(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        return weight

    def remake(self, c: torch.Tensor, weight, bias, j: int, k: int) -> torch.Tensor:
        y, mean, invstd = torch.ops.aten.native_batch_norm(c, weight, bias, None, None, True, 0.0, self.eps)
        self.stats = (mean, invstd)
        return y

    def backward(self, dy: torch.Tensor, c: torch.Tensor, weight, j: int, k: int):
        mean, invstd = self.stats
        return torch.ops.aten.native_batch_norm_backward(dy, c, weight, None, None, mean, invstd, True, self.eps,
                                                         [True, weight is not None, weight is not None])

    def finish(self, dc: torch.Tensor, c: torch.Tensor, weight, dw, db):
        return dc, dw, db


class _StreamedBatchNorm(torch.autograd.Function):
    """BatchNorm in training and its activation, whose backward remakes their output and
    back-propagates through both a run of channels at a time. The forward is the module's own
    (its running statistics move as they would, a dp group's statistics are exchanged as they
    would be); it keeps only BatchNorm's input. Each run of channels is a contiguous copy that
    the same kernels remake and back-propagate as the whole map's: BatchNorm's statistics and
    sums are per channel, so the gradients come out bit for bit as the whole map's would,
    while the backward holds, beside the incoming and outgoing gradients, a few maps of
    CHUNK_BYTES instead of three of the whole map's size."""

    @staticmethod
    def forward(ctx, c: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                bn: nn.modules.batchnorm._BatchNorm, act: nn.Module) -> torch.Tensor:
        a = act(bn(c))
        group = getattr(bn, "streamed", None)
        ctx.stream = (group() if group is not None else None) or _PlainStream(bn.eps)
        ctx.save_for_backward(c, weight, bias)
        ctx.act = act
        return a

    @staticmethod
    def backward(ctx, da: torch.Tensor):
        c, weight, bias = ctx.saved_tensors
        stream, act = ctx.stream, ctx.act
        weight = stream.weight(weight)
        dc = torch.empty_like(c)
        dw = torch.empty_like(weight) if weight is not None else None
        db = torch.empty_like(weight) if weight is not None else None
        run = max(1, CHUNK_BYTES // max(1, c[:, :1].numel() * c.element_size()))
        for j in range(0, c.shape[1], run):
            k = min(c.shape[1], j + run)
            cj = c[:, j:k].contiguous()
            wj = weight[j:k] if weight is not None else None
            yj = stream.remake(cj, wj, bias[j:k] if bias is not None else None, j, k)
            dyj = activation_backward(act, da[:, j:k].contiguous(), yj)
            dcj, dwj, dbj = stream.backward(dyj, cj, wj, j, k)
            dc[:, j:k] = dcj
            if dw is not None:
                dw[j:k], db[j:k] = dwj, dbj
        dc, dw, db = stream.finish(dc, c, weight, dw, db)
        return dc, dw, (db if bias is not None else None), None, None


def activation_backward(act: nn.Module, da: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient at the input `y` of a streamed activation (STREAMED) given `da` at its
    output: the kernel autograd runs for it, called directly, without the activation's forward
    on a copy of `y` that autograd's own backward would need."""
    if isinstance(act, nn.LeakyReLU):
        return torch.ops.aten.leaky_relu_backward(da, y, act.negative_slope, False)
    if isinstance(act, nn.ReLU6):
        return torch.ops.aten.hardtanh_backward(da, y, 0.0, 6.0)
    if isinstance(act, nn.ReLU):
        return torch.ops.aten.threshold_backward(da, y, 0)
    return da
