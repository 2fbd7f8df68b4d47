"""Cutting tensors into routed blocks and putting them back together."""
from __future__ import annotations

import torch

from planner.model_desc import ModelDesc
from planner.routing import Block


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
        return (desc.in_channels, desc.img_size, desc.img_size)
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
    return make(shape, dtype=like.dtype)


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
