"""Cutting tensors into routed blocks, putting them back together, and moving them between
the parts of neighbouring stages."""
from __future__ import annotations

import torch
import trio

from planner.model_desc import ModelDesc
from planner.plan import Plan
from planner.routing import Block, Layout, Part, runs
from swarm.execution import channels
from swarm.local.compute_device import HOST, to_host


def vector_outputs(desc: ModelDesc) -> set[int]:
    """Layers whose outputs are (B, N) vectors rather than (B, C, H, W) maps."""
    vec: set[int] = set()
    for layer in desc.layers:
        if layer.kind == "connected" or (layer.kind in ("dropout", "route") and layer.inputs[0] in vec):
            vec.add(layer.index)
    return vec


def map_shape(desc: ModelDesc, tensor: int) -> tuple[int, ...]:
    """Per-sample shape of a live tensor: -1 is the image."""
    if tensor < 0:
        return (desc.in_channels, *desc.img_size.hw)
    shape = desc.layers[tensor].out_shape
    return shape[:1] if tensor in vector_outputs(desc) else shape


def _span(span, size: int) -> tuple[int, int]:
    return span if span is not None else (0, size)


def cut(t: torch.Tensor, holder: Block, piece: Block) -> torch.Tensor:
    """The part of `t` (which covers `holder`) that covers `piece`, as a view."""
    s0 = piece.samples[0] - holder.samples[0]
    view = t[s0:s0 + piece.count]
    if t.dim() == 4 and (piece.rows is not None or piece.cols is not None):
        hr0, _ = _span(holder.rows, t.shape[2])
        hc0, _ = _span(holder.cols, t.shape[3])
        r0, r1 = _span(piece.rows, t.shape[2] + hr0)
        c0, c1 = _span(piece.cols, t.shape[3] + hc0)
        view = view[:, :, r0 - hr0:r1 - hr0, c0 - hc0:c1 - hc0]
    return view


def empty_for(block: Block, per_sample: tuple[int, ...], like: torch.Tensor, zero: bool) -> torch.Tensor:
    """A tensor covering `block` of a map whose per-sample shape is `per_sample`."""
    shape = [block.count, *per_sample]
    if len(per_sample) == 3:
        shape[2] = _span(block.rows, per_sample[1])[1] - _span(block.rows, per_sample[1])[0]
        shape[3] = _span(block.cols, per_sample[2])[1] - _span(block.cols, per_sample[2])[0]
    make = torch.zeros if zero else torch.empty
    return make(shape, dtype=like.dtype, device=like.device)


def assemble(block: Block, per_sample: tuple[int, ...], pieces: list[tuple[Block, torch.Tensor]],
             add: bool) -> torch.Tensor:
    """Put pieces (each covering its block) into one tensor covering `block`. With `add`,
    overlapping pieces are summed (in the given order); otherwise they are copied."""
    if len(pieces) == 1 and pieces[0][0] == block:
        return pieces[0][1]
    out = empty_for(block, per_sample, pieces[0][1], zero=add)
    for piece_block, piece in pieces:
        target = cut(out, block, piece_block)
        if add:
            target += piece
        else:
            target.copy_(piece)
    return out


class BlockPost:
    """Moves one device's blocks between the parts of neighbouring stages for one epoch: a
    part's input blocks in (the image for stage 0) and its output blocks out, and backward
    the same for gradients. The layout (planner.routing.Layout) says who holds what.

    A block for a part on this device is handed over as it is, on the device that computed
    it (consecutive stages on one accelerator never go through the host); a block for another
    device is brought to the host once, as its message (`to_host`: from an accelerator, in a
    thread of its own, so the copy overlaps the compute thread's next work)."""

    def __init__(self, ep, plan: Plan, desc: ModelDesc, layout: Layout, timeout_s: float):
        self.ep = ep
        self.plan = plan
        self.desc = desc
        self.layout = layout
        self.timeout_s = timeout_s
        self.device = ep.name

    async def _get(self, key):
        return await self.ep.mailbox.get(key, self.timeout_s)

    async def gather_inputs(self, step: int, part: Part, m: int, mb: int) -> dict[int, torch.Tensor]:
        """The part's input block of every map entering its stage (the image for stage 0)."""
        p = part.stage
        if p == 0:
            return {-1: (await self._get(channels.feed(step, part.index, m)))["arrays"][0]}
        holding = self.layout.inputs(p, mb)[part.index].block
        incoming = [t for t in self.layout.forward_transfers(p - 1, mb)
                    if t.dst == part and runs(self.plan, t.src, m)]
        inputs = {}
        for tensor in self.desc.live_after(self.plan.stages[p].first):
            pieces = []
            for t in incoming:
                msg = await self._get(channels.act(step, p, part.index, m, tensor, t.src.index))
                pieces.append((t.block, msg["arrays"][0]))
            inputs[tensor] = assemble(holding, map_shape(self.desc, tensor), pieces, add=False)
        return inputs

    async def send_outputs(self, step: int, part: Part, m: int, mb: int, outputs: dict[int, torch.Tensor]) -> None:
        p = part.stage
        out_block = self.layout.outputs(p, mb)[part.index].block
        for t in self.layout.forward_transfers(p, mb):
            if t.src != part or not runs(self.plan, t.dst, m):
                continue
            for tensor, value in outputs.items():
                piece = cut(value, out_block, t.block)
                await self.ep.send(t.dst.device, channels.act(step, p + 1, t.dst.index, m, tensor, part.index),
                                   {"arrays": [await self._handed_over(piece, t.dst.device)]})

    async def gather_output_grads(self, step: int, part: Part, m: int, mb: int) -> dict[int, torch.Tensor]:
        """dL/d(output) on the part's output block, summed over the pieces that come back."""
        p = part.stage
        out_block = self.layout.outputs(p, mb)[part.index].block
        incoming = [t for t in self.layout.backward_transfers(p, mb)
                    if t.dst == part and runs(self.plan, t.src, m)]
        grads = {}
        for tensor in self.desc.live_after(self.plan.stages[p].last):
            pieces = []
            for t in incoming:
                msg = await self._get(channels.grad(step, p, part.index, m, tensor, t.src.index))
                pieces.append((t.block, msg["arrays"][0]))
            if pieces:
                grads[tensor] = assemble(out_block, map_shape(self.desc, tensor), pieces, add=True)
        return grads

    async def send_input_grads(self, step: int, part: Part, m: int, mb: int, in_grads: dict[int, torch.Tensor]) -> None:
        p = part.stage
        block = self.layout.input_grads(p, mb)[part.index].block
        for t in self.layout.backward_transfers(p - 1, mb):
            if t.src != part or not runs(self.plan, t.dst, m):
                continue
            for tensor in self.desc.live_after(self.plan.stages[p].first):
                g = in_grads.get(tensor)
                if g is None:
                    continue
                piece = cut(g, block, t.block)
                await self.ep.send(t.dst.device, channels.grad(step, p - 1, t.dst.index, m, tensor, part.index),
                                   {"arrays": [await self._handed_over(piece, t.dst.device)]})

    async def _handed_over(self, piece: torch.Tensor, device: str) -> torch.Tensor:
        """`piece` as it goes to `device`: itself for a part on this device, else its message's
        one contiguous host copy."""
        if device == self.device:
            return piece
        if piece.device != HOST:  # from an accelerator: copied in a thread, overlapping compute
            return await trio.to_thread.run_sync(to_host, piece)
        return to_host(piece).contiguous()
