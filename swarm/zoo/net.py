"""The torch network built from a .cfg: a list of layers, some of which read earlier outputs."""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.checkpoint import stage_segments
from planner.model_desc import ModelDesc
from swarm.zoo.layers import Weighted
from swarm.zoo.recompute import Recipes

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant for mixing dropout seeds
_MASK64 = (1 << 64) - 1


def dropout_seed(key: int, layer: int) -> int:
    """A per-(sample, layer) seed, so a sample's dropout mask is the same whichever device,
    micro-batch or position it is computed in."""
    z = (key * _MIX + layer * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Net(nn.Module):
    """Layers in darknet order. `forward_range` runs any consecutive slice given the tensors
    that cross into it, which is what a pipeline stage does."""

    def __init__(self, desc: ModelDesc, modules: list[nn.Module], dropout_p: dict[int, float]):
        super().__init__()
        self.desc = desc
        self.layers = nn.ModuleList(modules)
        self.dropout_p = dropout_p
        self._recompute: frozenset[int] = frozenset()
        # a training forward runs in the model's checkpointed segments (planner.checkpoint):
        # a plan's choice (Stage.checkpoint), set by whoever runs the net
        self.checkpoint = False

    @property
    def recompute(self) -> frozenset[int]:
        """The layers whose BatchNorm output and activation result a training backward remakes
        rather than keeps (swarm.zoo.recompute): a plan's choice, set by whoever runs the net.
        Only conv and connected layers with BatchNorm can be among them."""
        return self._recompute

    @recompute.setter
    def recompute(self, layers) -> None:
        layers = frozenset(layers)
        for i, module in enumerate(self.layers):
            if i in layers and not (isinstance(module, Weighted) and hasattr(module, "bn")):
                raise ValueError(f"layer {i} has no BatchNorm to recompute")
            if isinstance(module, Weighted):
                module.remade = i in layers
        self._recompute = layers

    def forward(self, x: torch.Tensor, keys: list[int] | None = None) -> torch.Tensor:
        """x: (B, C, S, S) uint8 image or float in [0, 1]; keys: one int per sample, used to
        draw dropout masks (needed only when the net has dropout and is training)."""
        out = self.forward_range(0, len(self.layers), {-1: x}, keys)
        return self.desc.head_of(out)

    def forward_range(self, first: int, last: int, live: dict[int, torch.Tensor],
                      keys: list[int] | None = None) -> dict[int, torch.Tensor]:
        """Run layers [first, last). `live` holds the outputs (by layer index, -1 for the
        image) that this range reads from before `first`; returns those that layers at or
        after `last` read (or the final output when `last` is the end)."""
        outs = dict(live)
        if -1 in outs and outs[-1].dtype == torch.uint8:  # images travel as bytes
            outs[-1] = outs[-1].to(self.dtype).div_(255.0)
        crossing = self.desc.live_after(last)
        remade = [i for i in range(first, last) if i in self._recompute] if self.training else []
        if self.checkpoint and self.training and torch.is_grad_enabled():
            self._run_segments(first, last, outs, set(crossing), keys)
        elif remade and torch.is_grad_enabled():
            with Recipes():
                self._run(first, last, outs, set(crossing), keys)
        else:
            self._run(first, last, outs, set(crossing), keys)
        return {k: outs[k] for k in crossing}

    def _run(self, first: int, last: int, outs: dict[int, torch.Tensor], crossing: set[int], keys) -> None:
        """Layers [first, last) into `outs`; a map that no later layer of the range reads and
        that does not cross `last` is let go as soon as its last reader has run."""
        layers = self.desc.layers
        last_reader = {s: i for i in range(first, last) for s in layers[i].inputs}
        for i in range(first, last):
            d = layers[i]
            xs = [outs[s] for s in d.inputs]
            for s in d.inputs:
                if last_reader[s] == i and s not in crossing:
                    outs.pop(s, None)
            if d.kind == "dropout":
                y = self._dropout(xs[0], i, keys)
            elif d.kind == "crop":
                y = self.layers[i](xs[0], self._seeds(i, keys, len(xs[0])))
            elif d.kind == "connected" and xs[0].dim() > 2:
                y = self.layers[i](xs[0].flatten(1))  # (B, C*H*W)
            else:
                y = self.layers[i](*xs)
            outs[i] = y

    def _run_segments(self, first: int, last: int, outs: dict[int, torch.Tensor], crossing: set[int], keys) -> None:
        """Layers [first, last) in checkpointed segments (planner.checkpoint.stage_segments):
        each segment's forward keeps only the maps it reads from before it, and autograd runs
        it again in the backward, keeping everything, before back-propagating through it.
        Dropout and crops draw from the samples' keys, so the second forward is the first's to
        the bit; BatchNorm's running statistics, which it would move again, are put back."""
        layers = self.desc.layers
        for a, b in stage_segments(self.desc, first, last):
            reads = sorted({s for i in range(a, b) for s in layers[i].inputs if s < a})
            later = crossing | {s for i in range(b, last) for s in layers[i].inputs}
            made = [i for i in range(a, b) if i in later]

            def segment(*xs, a=a, b=b, reads=reads, made=made):
                local = dict(zip(reads, xs))
                self._run(a, b, local, set(made), keys)
                return tuple(local[i] for i in made)

            ys = checkpoint(segment, *[outs[s] for s in reads], use_reentrant=False,
                            context_fn=lambda a=a, b=b: (contextlib.nullcontext(), self._running_kept(a, b)))
            for s in reads:
                if s not in later:
                    outs.pop(s, None)
            outs.update(zip(made, ys))

    @contextlib.contextmanager
    def _running_kept(self, first: int, last: int):
        """BatchNorm's running statistics of layers [first, last) as they were on entry, again on exit."""
        bns = [m for layer in self.layers[first:last] for m in layer.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        kept = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in bns]
        try:
            yield
        finally:
            with torch.no_grad():
                for m, (mean, var, count) in zip(bns, kept):
                    m.running_mean.copy_(mean)
                    m.running_var.copy_(var)
                    m.num_batches_tracked.copy_(count)

    @property
    def dtype(self) -> torch.dtype:
        """The floating type of the weights (float32 unless the net was converted)."""
        for p in self.parameters():
            return p.dtype
        return torch.get_default_dtype()

    def _seeds(self, layer: int, keys: list[int] | None, count: int) -> list[int] | None:
        """One seed a sample for a layer that draws in training ([crop]); None in use."""
        if not self.training:
            return None
        if keys is None or len(keys) != count:
            raise ValueError("training with a [crop] layer needs one key per sample")
        return [dropout_seed(int(key), layer) for key in keys]

    def _dropout(self, x: torch.Tensor, layer: int, keys: list[int] | None) -> torch.Tensor:
        p = self.dropout_p[layer]
        if not self.training or p == 0.0:
            return x
        if keys is None or len(keys) != x.shape[0]:
            raise ValueError("training with dropout needs one key per sample")
        masks = []
        for key in keys:
            gen = torch.Generator().manual_seed(dropout_seed(int(key), layer))
            masks.append(torch.rand(x.shape[1:], generator=gen) >= p)
        return x * torch.stack(masks).to(x.device, x.dtype) / (1.0 - p)  # drawn on the CPU: alike on every device
