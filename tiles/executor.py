"""The tiled executor: one tile's forward and backward pass over a stage, as generators of collectives.

    worker = TileWorker(layout, tile=k, modules=net.layers[first:last])
    out = yield from worker.forward(mb, x_rect)      # x_rect: the stage input on layout.input_rect(k)
    dx = yield from worker.backward(mb, dy_own)      # dy_own: dL/d(output) on layout.output_rect(k)

Why generators. A tile computes locally until it needs something from the other tiles:
a halo at a sync boundary, or the per-channel sums of a BatchNorm layer. There it yields
a request (tiles.requests) and is resumed with the answer. The same code therefore
runs under any driver:
  - tiles.driver.run_lockstep steps all tiles of a stage in one process, one after another,
    and answers the requests from memory (the in-process trainer, the tests);
  - a distributed driver steps the tiles one device owns, each `send()` in a worker thread,
    while its event loop moves halos and sums between devices (messages matched by
    request key and tile; their rects and sizes are in the StageLayout beforehand).
Several micro-batches may be in flight (1F1B): forward(mb) keeps what backward(mb) needs
under the micro-batch id until backward(mb) runs.

Inputs and outputs. Forward takes the stage input on the tile's input rectangle
(`layout.input_rect(k)`: owned pixels plus the first group's halo; the feeder cuts it, e.g.
the coordinator sends each device only its rectangle of the uint8 image) and returns the
output on the tile's owned rectangle. Backward takes dL/d(output) on the owned rectangle
only: the stage end is always a backward sync, so the halo the first backward group needs
is exchanged between the tiles there, after each owner has taken its pixels back through
BatchNorm and the activation. It returns dL/d(input) on the owned input rectangle, or None
for a stage without input deltas (the first stage).

Graph stages. A tile holds the maps of its stage by boundary, each on the region its layer
computed (`fwd_out`), until their last reader has run; a shortcut or route reads its inputs
on its own output pixels and computes only those (they exchange nothing). Backward, the
gradient of each map is gathered by boundary: every reader adds what it gives back (a
route into its part of the input's channels), and the map's layer takes the sum once all
its readers, which come later in the stage, have run.

What a tile keeps between forward and backward, per layer (regions from tiles.layout):
  conv      its input on the windows of its owned outputs (for the partial weight gradient),
            and the conv output z on the pointwise region (BatchNorm and the activation are
            recomputed from z in backward, as cheap elementwise ops);
  maxpool   the selected window position (uint8) on the outputs its backward uses;
  shortcut  the sum before its activation, on its owned pixels (nothing when linear);
  avgpool, route, upsample   nothing.
Partial weight gradients (owned outputs only) are added into the modules' `.grad`; tiles
sharing modules in one process therefore sum to the full gradient. BatchNorm running
statistics are updated by the workers created with keeps_running_stats=True (one per copy
of the modules).
"""
from __future__ import annotations

import threading
from collections.abc import Generator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tiles import ops
from tiles.layout import StageLayout
from tiles.regions import LayerGeometry, Rect, TilingError
from tiles.requests import ChannelSums, HaloExchange


@dataclass
class LayerParts:
    """The torch pieces of one tileable layer (an nn.Sequential from the model zoo, or its
    Shortcut, Route or Upsample)."""

    geometry: LayerGeometry
    conv: nn.Conv2d | None = None
    bn: nn.BatchNorm2d | None = None
    act: nn.Module | None = None
    scale: float = 1.0  # upsample: the factor its copies are multiplied by

    @classmethod
    def of(cls, geometry: LayerGeometry, module: nn.Module) -> "LayerParts":
        g = geometry
        if g.kind == "conv":
            conv = module.conv
            if conv.kernel_size != (g.rows.kernel, g.cols.kernel) or conv.stride != (g.rows.stride, g.cols.stride) \
                    or conv.groups != 1 or conv.dilation != (1, 1):
                raise TilingError(f"layer {g.index}: the module does not match its description")
            bn = getattr(module, "bn", None)
            return cls(g, conv, bn, getattr(module, "act", nn.Identity()))
        if g.kind == "maxpool":
            pool = module.pool
            if not isinstance(pool, nn.MaxPool2d) or pool.padding not in (0, (0, 0)) or pool.ceil_mode:
                raise TilingError(f"layer {g.index}: unsupported max-pool module {pool}")
            return cls(g)
        if g.kind == "avgpool":
            if not isinstance(module.pool, nn.AvgPool2d):
                raise TilingError(f"layer {g.index}: global average pooling cannot be tiled")
            return cls(g)
        if g.kind == "upsample":
            if getattr(module, "stride", None) != g.rows.up:
                raise TilingError(f"layer {g.index}: the module does not match its description")
            return cls(g, scale=float(module.scale))
        if g.kind == "shortcut":
            act = getattr(module, "act", None)
            return cls(g, act=act if act is not None else nn.Identity())
        if g.kind == "route":
            if getattr(module, "groups", 1) > 1 and not g.channel_parts:
                raise TilingError(f"layer {g.index}: the module does not match its description")
            return cls(g)
        raise TilingError(f"layer {g.index} ({g.kind}) cannot be tiled")

    @property
    def params(self) -> list[nn.Parameter]:
        out = []
        for m in (self.conv, self.bn):
            if m is not None:
                out += [p for p in m.parameters()]
        return out


@dataclass
class Saved:
    """What one layer keeps from forward to backward for one micro-batch."""

    xw: torch.Tensor | None = None  # conv: padded input on the owned outputs' windows (B, Cin, *, *)
    z: torch.Tensor | None = None  # conv: output before BN/activation on bwd_state (B, Cout, *, *),
    #                                    less the micro-batch's mean if BatchNorm follows;
    #                                    shortcut: the sum before its activation, on own
    invstd: torch.Tensor | None = None  # (G, C)
    selection: torch.Tensor | None = None  # maxpool: selected window position on bwd_state (B, C, *, *) uint8

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.xw, self.z, self.invstd, self.selection)
                   if t is not None)


@dataclass
class MicroBatchState:
    batch: int
    spread: ops.Spread  # the micro-batches of the block, each with its own BatchNorm statistics
    layers: dict[int, Saved] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers.values())


Work = Generator[object, object, object]


class TileWorker:
    """One tile of a tiles stage: forward and backward generators over its regions."""

    def __init__(self, layout: StageLayout, tile: int, modules, keeps_running_stats: bool = True,
                 grad_lock: threading.Lock | None = None):
        if len(modules) != len(layout.layers):
            raise TilingError(f"{len(modules)} modules for a stage of {len(layout.layers)} layers")
        self.layout = layout
        self.tile = tile
        self.regions = layout.tiles[tile]
        self.parts = {g.index: LayerParts.of(g, m) for g, m in zip(layout.layers, modules)}
        self.dtype = next((p.conv.weight.dtype for p in self.parts.values() if p.conv is not None), None)
        self.keeps_running_stats = keeps_running_stats
        # if set, called as sink(micro-batch, layer, mean, var, count) instead of updating the
        # running statistics (a driver that must apply them in another order)
        self.running_stats_sink = None
        self.grad_lock = grad_lock
        self.saved: dict[int, MicroBatchState] = {}
        # called as on_layer_done(mb, layer) once this tile's weight gradients of a layer are in
        # (a driver may then start summing that layer over the devices while backward goes on)
        self.on_layer_done = None

    # ---- forward --------------------------------------------------------------------------
    def forward(self, mb: int, x: torch.Tensor, splits: tuple[int, ...] | None = None) -> Work:
        """x: (B, C, h, w) stage input on this tile's input rect (uint8 images are scaled to
        [0, 1] as the untiled net does). Returns the output on the tile's owned rect.

        `splits` runs several micro-batches as one block (samples per micro-batch, summing
        to B): fewer, larger computations and one exchange per sync for all of them, while
        each micro-batch keeps its own BatchNorm statistics and running-statistics update,
        so the result is the one they give run one after another."""
        splits = tuple(splits) if splits is not None else (x.shape[0],)
        if sum(splits) != x.shape[0] or min(splits) < 1:
            raise TilingError(f"micro-batch sizes {splits} do not make up a block of {x.shape[0]} samples")
        lay, t = self.layout, self.regions
        dtype = self.dtype or torch.get_default_dtype()
        if x.dtype == torch.uint8:
            x = x.to(dtype).div_(255.0)  # as the untiled net does
        elif x.dtype != dtype and self.dtype is not None:
            x = x.to(dtype)
        if tuple(x.shape[2:]) != t.input_rect.shape:
            raise TilingError(f"tile {self.tile} needs its input on {t.input_rect.shape}, got {tuple(x.shape[2:])}")
        state = MicroBatchState(x.shape[0], ops.Spread(splits, x.device))
        self.saved[mb] = state
        maps = {lay.first: (x, t.input_rect)}  # boundary -> (the map on the region this tile holds, that region)
        unread = {b: len(ls) for b, ls in lay.readers.items()}
        for l in range(lay.first, lay.last):
            p = self.parts[l]
            g = p.geometry
            if g.graph:
                y = self._graph_forward(state, p, [ops.crop(*maps[b], t.own[l + 1]) for b in g.reads])
            else:
                have, have_rect = maps[l]
                in_rect, padding = t.fwd_in[l]
                if l > lay.first and l in lay.grouping.forward:
                    have = yield from self._exchange(mb, "forward", l, have, have_rect, in_rect)
                    have_rect = in_rect
                y = yield from self._layer_forward(mb, state, p, ops.crop(have, have_rect, in_rect), padding)
            for b in g.reads:
                unread[b] -= 1
                if unread[b] == 0:
                    maps.pop(b, None)
            maps[l + 1] = (y, t.fwd_out[l + 1])
        y, rect = maps[lay.last]
        return ops.crop(y, rect, t.own[lay.last])

    def _graph_forward(self, state: MicroBatchState, p: LayerParts, xs: list[torch.Tensor]) -> torch.Tensor:
        """A shortcut or route on this tile's owned pixels, from its inputs there."""
        g = p.geometry
        if g.kind == "route":
            pieces = [x if (lo, hi) == (0, c) else x[:, lo:hi] for x, (c, lo, hi) in zip(xs, g.channel_parts)]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        u = xs[0]
        for x in xs[1:]:  # in the order the untiled Shortcut adds them
            u = u + x
        if g.pointwise_state:
            state.layers[g.index] = Saved(z=u)
            return ops.activation_forward(p.act, u, inplace=False)
        return u if len(xs) > 1 else u.clone()

    def _layer_forward(self, mb: int, state: MicroBatchState, p: LayerParts, x: torch.Tensor, padding) -> Work:
        g, t = p.geometry, self.regions
        l, out_rect = g.index, t.fwd_out[g.index + 1]
        saved = Saved()
        state.layers[l] = saved
        if g.kind == "maxpool":
            xp = ops.pad(x, padding, float("-inf"))  # (B, C, hp, wp)
            y, code = ops.maxpool_forward(xp, g.rows.kernel, g.rows.stride)  # (B, C, out_rect) each
            keep = t.bwd_state[l]
            if not keep.empty:
                saved.selection = _keep(ops.crop(code, out_rect, keep), code)
            return y
        if g.kind == "avgpool":
            return F.avg_pool2d(ops.pad(x, padding, 0.0), g.rows.kernel, g.rows.stride)
        if g.kind == "upsample":
            up, in_rect = g.rows.up, t.fwd_in[l][0]
            b, c, h, w = x.shape  # (B, C, h, w) -> (B, C, h*up, w*up), then the rows and columns wanted
            y = x[:, :, :, None, :, None].expand(b, c, h, up, w, up).reshape(b, c, h * up, w * up)
            y = ops.crop(y, Rect.of(in_rect.rows.lo * up, in_rect.rows.hi * up, in_rect.cols.lo * up,
                                    in_rect.cols.hi * up), out_rect)
            return y * p.scale if p.scale != 1.0 else y.contiguous()
        # conv (+ BatchNorm) (+ activation)
        with torch.no_grad():
            xp = ops.pad(x, padding, 0.0)  # (B, Cin, hp, wp)
            z = F.conv2d(xp, p.conv.weight, p.conv.bias, stride=g.rows.stride)  # (B, Cout, out_rect)
        saved.xw = _keep(self._window_crop(xp, g, out_rect, t.own[l + 1]), xp)
        if p.bn is None:
            if g.pointwise_state:
                saved.z = _keep(ops.crop(z, out_rect, t.bwd_state[l]), z)
            return ops.activation_forward(p.act, z, inplace=saved.z is not z)
        spread = state.spread
        pixels = g.rows.size_out * g.cols.size_out
        z_own = ops.crop(z, out_rect, t.own[l + 1])
        local = torch.stack([ops.forward_sums(part) for part in spread.parts(z_own)])  # (G, 2, C)
        total = yield ChannelSums(mb, "forward", l, local)
        mean, var, invstd = ops.batch_stats(total, spread.counts(pixels), p.bn.eps, z.dtype)  # (G, C) each
        if self.keeps_running_stats:
            with torch.no_grad():
                for row, size in enumerate(spread.splits):  # in micro-batch order, as run one by one
                    if self.running_stats_sink is not None:
                        self.running_stats_sink(mb + row, l, mean[row], var[row], size * pixels)
                    else:
                        ops.update_running_stats(p.bn, mean[row], var[row], size * pixels)
        saved.invstd = invstd
        alpha, beta = ops.bn_scale_shift(p.bn, invstd)
        # Backward keeps z - mean on bwd_state (centred, so that its arithmetic cancels nothing):
        # z itself centred in place when that is all of it, else a centred copy of the part.
        keep = ops.crop(z, out_rect, t.bwd_state[l])
        if keep.shape == z.shape:
            saved.z = z.sub_(spread(mean))
            u = torch.addcmul(beta, z, spread(alpha))
        else:
            saved.z = torch.sub(keep, spread(mean))
            u = torch.addcmul(spread(beta.view(1, -1) - mean * alpha), z, spread(alpha), out=z)
        return ops.activation_forward(p.act, u, inplace=True)

    @staticmethod
    def _window_crop(xp: torch.Tensor, g: LayerGeometry, out_rect: Rect, want: Rect) -> torch.Tensor:
        """The part of a padded input (for outputs out_rect) that outputs `want` read."""
        r0 = (want.rows.lo - out_rect.rows.lo) * g.rows.stride
        c0 = (want.cols.lo - out_rect.cols.lo) * g.cols.stride
        r1 = r0 + (want.rows.size - 1) * g.rows.stride + g.rows.kernel
        c1 = c0 + (want.cols.size - 1) * g.cols.stride + g.cols.kernel
        return xp[:, :, r0:r1, c0:c1]

    # ---- backward -------------------------------------------------------------------------
    def backward(self, mb: int, dy: torch.Tensor) -> Work:
        """dy: dL/d(stage output) on this tile's owned output rect. Returns dL/d(stage input)
        on its owned input rect (None for a stage that produces no input delta)."""
        lay, t = self.layout, self.regions
        state = self.saved.pop(mb)
        own_top = t.own[lay.last]
        if tuple(dy.shape[2:]) != own_top.shape:
            raise TilingError(f"tile {self.tile} needs its output delta on {own_top.shape}, got {tuple(dy.shape[2:])}")
        deltas = {lay.last: (dy, own_top)}  # boundary -> (dL/d(map), its region): the readers' sum so far
        for l in range(lay.last - 1, lay.first - 1, -1):
            got = deltas.pop(l + 1, None)
            if got is None:  # nothing below needs this map's delta (only pools below, in a first stage)
                continue
            cur, cur_rect = got
            p, saved, b = self.parts[l], state.layers.get(l), l + 1
            if p.geometry.graph:
                self._graph_backward(p, saved, cur, cur_rect, deltas)
                continue
            dz = yield from self._pointwise_backward(mb, state, p, saved, cur, cur_rect)
            if p.conv is not None:
                self._weight_grads(p, saved, dz, cur_rect)
                if self.on_layer_done is not None:
                    self.on_layer_done(mb, l)
            dz_rect = cur_rect
            if b in lay.grouping.backward:
                dz = yield from self._exchange(mb, "backward", b, dz, cur_rect, t.bwd_in[l])
                dz_rect = t.bwd_in[l]
            want = t.bwd_delta[l]
            if want.empty:
                continue
            if b in lay.selection_transfers:
                yield from self._share_selections(mb, b, saved)
            _add_delta(deltas, l, want, self._window_backward(p, saved, ops.crop(dz, dz_rect, t.bwd_in[l]), want))
        if not lay.input_delta:
            return None
        return deltas[lay.first][0]

    def _graph_backward(self, p: LayerParts, saved: "Saved | None", dy: torch.Tensor, rect: Rect, deltas: dict) -> None:
        """A shortcut or route gives each input its share of dL/d(output) on the owned pixels."""
        g, lay = p.geometry, self.layout
        if g.pointwise_state:
            dy = ops.activation_backward(p.act, saved.z, dy)
        offset = 0
        for k, b in enumerate(g.reads):
            if g.channel_parts:
                channels, lo, hi = g.channel_parts[k]
                part, offset = dy[:, offset:offset + hi - lo], offset + hi - lo
            else:
                channels, lo, hi, part = g.out_channels, 0, g.out_channels, dy
            if b == lay.first and not lay.input_delta:
                continue
            _add_delta(deltas, b, rect, part, (channels, lo, hi))

    def _pointwise_backward(self, mb: int, state: MicroBatchState, p: LayerParts, saved: Saved,
                            dy: torch.Tensor, rect: Rect) -> Work:
        """Through the activation and BatchNorm of a conv layer, on `rect` (its pointwise region)."""
        g = p.geometry
        if g.kind != "conv" or not g.pointwise_state:
            return dy
        own = self.regions.own[g.index + 1]
        if p.bn is None:
            return ops.activation_backward(p.act, saved.z, dy)
        spread = state.spread
        alpha, beta = ops.bn_scale_shift(p.bn, saved.invstd)
        du = ops.activation_backward(p.act, torch.addcmul(beta, saved.z, spread(alpha)), dy, overwrite=True)
        du_own, zc_own = ops.crop(du, rect, own), ops.crop(saved.z, rect, own)
        local = torch.stack([ops.backward_sums(a, b, invstd) for a, b, invstd in
                             zip(spread.parts(du_own), spread.parts(zc_own), saved.invstd)])  # (G, 2, C)
        if p.bn.affine:
            both = local.sum(dim=0)  # (2, C): the micro-batches' contributions, in order
            self._accumulate(p.bn.weight, both[1].to(du.dtype))
            self._accumulate(p.bn.bias, both[0].to(du.dtype))
        counts = spread.counts(g.rows.size_out * g.cols.size_out)
        total = yield ChannelSums(mb, "backward", g.index, local)
        return ops.bn_input_grad(du, saved.z, total, counts, saved.invstd, p.bn.weight if p.bn.affine else None, spread)

    def _weight_grads(self, p: LayerParts, saved: Saved, dz: torch.Tensor, rect: Rect) -> None:
        own = self.regions.own[p.geometry.index + 1]
        dz_own = ops.crop(dz, rect, own)
        self._accumulate(p.conv.weight, ops.conv_weight_grad(saved.xw, dz_own, p.conv.weight, p.geometry.rows.stride))
        if p.conv.bias is not None:
            self._accumulate(p.conv.bias, dz_own.sum(dim=(0, 2, 3)))

    def _window_backward(self, p: LayerParts, saved: Saved, dz: torch.Tensor, want: Rect) -> torch.Tensor:
        """dL/d(input) on `want` from the gradient at the window output on the outputs touching it."""
        g, t = p.geometry, self.regions
        need = t.bwd_in[g.index]
        if g.kind == "upsample":  # each input pixel: the sum over its copies (need is want's copies, whole)
            up = g.rows.up
            b, c, h, w = dz.shape
            dx = dz.reshape(b, c, h // up, up, w // up, up).sum(dim=(3, 5))
            return dx * p.scale if p.scale != 1.0 else dx
        if g.kind == "conv":
            full = ops.conv_input_grad(dz, p.conv.weight, g.rows.stride)
            origin = need
        elif g.kind == "maxpool":
            code = ops.crop(saved.selection, t.bwd_state[g.index], need)
            extent = ((need.rows.size - 1) * g.rows.stride + g.rows.kernel,
                      (need.cols.size - 1) * g.cols.stride + g.cols.kernel)
            full = ops.maxpool_input_grad(dz, code, g.rows.kernel, g.rows.stride, extent)
            origin = need
        else:
            full = ops.avgpool_input_grad(dz, g.rows.kernel, g.rows.stride)
            origin = need
        # `full` covers the (unclipped) input extent read by the outputs in `origin`
        r0 = origin.rows.lo * g.rows.stride - g.rows.before
        c0 = origin.cols.lo * g.cols.stride - g.cols.before
        extent = Rect.of(r0, r0 + full.shape[2], c0, c0 + full.shape[3])
        if extent.contains(want):
            return ops.crop(full, extent, want)
        # input pixels no window reads (a stride that skips the last rows or columns): zero gradient
        out = full.new_zeros((*full.shape[:2], *want.shape))
        part = want.meet(extent)
        if not part.empty:
            rows, cols = part.relative_to(want)
            out[:, :, rows, cols] = ops.crop(full, extent, part)
        return out

    def _share_selections(self, mb: int, boundary: int, saved: Saved) -> Work:
        """Max-pool windows this tile evaluated but does not own take their owner's selection."""
        lay, keep = self.layout, self.regions.bwd_state[boundary - 1]
        sends = [(tr.dst, tr.rect, ops.crop(saved.selection, keep, tr.rect))
                 for tr in lay.transfers_from("selection", boundary, self.tile)]
        recvs = lay.transfers_into("selection", boundary, self.tile)
        got = yield HaloExchange(mb, "selection", boundary, sends, [(tr.src, tr.rect) for tr in recvs])
        for tr, code in zip(recvs, got):
            rows, cols = tr.rect.relative_to(keep)
            saved.selection[:, :, rows, cols] = code

    # ---- shared pieces --------------------------------------------------------------------
    def _exchange(self, mb: int, phase: str, boundary: int, have: torch.Tensor, have_rect: Rect, need: Rect) -> Work:
        """Yield a HaloExchange; return `need` assembled from `have` and the received parts."""
        lay = self.layout
        sends = [(tr.dst, tr.rect, ops.crop(have, have_rect, tr.rect))
                 for tr in lay.transfers_from(phase, boundary, self.tile)]
        recvs = lay.transfers_into(phase, boundary, self.tile)
        got = yield HaloExchange(mb, phase, boundary, sends, [(tr.src, tr.rect) for tr in recvs])
        if have_rect.contains(need):
            return ops.crop(have, have_rect, need)
        mine = need.meet(have_rect)
        parts = [(mine, ops.crop(have, have_rect, mine))] + [(tr.rect, x) for tr, x in zip(recvs, got)]
        return ops.assemble(tuple(have.shape[:2]), need, parts, have)

    def _accumulate(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        lock = self.grad_lock
        if lock is not None:
            lock.acquire()
        try:
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad.add_(grad)
        finally:
            if lock is not None:
                lock.release()

    def saved_bytes(self, mb: int | None = None) -> int:
        """Bytes this tile keeps for backward (one micro-batch, or all in flight)."""
        states = [self.saved[mb]] if mb is not None else list(self.saved.values())
        return sum(s.nbytes() for s in states)


def _add_delta(deltas: dict, boundary: int, rect: Rect, value: torch.Tensor,
               channels: tuple[int, int, int] | None = None) -> None:
    """Add a reader's dL/d(map) on `rect` to what the map's other readers gave; `channels`
    (C, lo, hi): the value is channels lo..hi of the map's C. Never in place on a value
    already given: one tensor may be given to several maps (a shortcut's inputs)."""
    old = deltas.get(boundary)
    if old is not None and old[1] != rect:
        raise TilingError(f"the delta of boundary {boundary} comes on {old[1]} and {rect}")
    if channels is not None and (channels[1], channels[2]) != (0, channels[0]):
        c, lo, hi = channels
        full = value.new_zeros((value.shape[0], c, *value.shape[2:])) if old is None else old[0].clone()
        full[:, lo:hi] += value
        deltas[boundary] = (full, rect)
        return
    deltas[boundary] = (value, rect) if old is None else (old[0] + value, rect)


def _keep(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Keep a crop without pinning the whole tensor: copy unless it is the whole."""
    return whole if part.shape == whole.shape else part.clone()
