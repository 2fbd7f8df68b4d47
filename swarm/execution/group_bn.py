"""BatchNorm over a micro-batch that is spread across the replicas of a dp group.

Each replica summarises its samples per channel (count, mean, sum of squared deviations),
the group combines the summaries (Chan et al.'s parallel variance), and every replica
normalises with the statistics of the whole micro-batch. Backward, the per-channel sums of
dy and dy * xhat are combined the same way. Weight and bias gradients stay local partial
sums: the group's gradient all-reduce at the end of the step adds them up. The result is
BatchNorm2d on the whole micro-batch, and running statistics advance identically
everywhere.

Replicas of a stage that each run their own micro-batches (a replicated single, dp or tiles
stage) end each step by combining their running statistics as one device running every
micro-batch in order would have moved them (merge_running_stats, replay_running_stats).
"""
from __future__ import annotations

from typing import Callable

import torch
import trio
from torch import nn

from swarm.execution import channels
from swarm.execution.collectives import allgather
from swarm.local.compute_device import to_host
from tiles.ops import update_running_stats

# exchange(tag, tensors) -> list over the group (in group order) of each member's tensors
Exchange = Callable[[str, list[torch.Tensor]], list[list[torch.Tensor]]]


class _GroupBatchNorm(torch.autograd.Function):
    """The arithmetic is torch's own fused kernels wherever the group's sums allow: this
    replica's statistics by BatchNorm's own statistics kernel (batch_norm_update_stats, in the
    input's dtype; combined in float64), the output by batch_norm with the group's statistics,
    and backward's two per-channel sums by the eval-mode BatchNorm backward, which computes
    exactly them. Written out elementwise, the layer cost a yolov2-16 sample 55% more compute
    than native BatchNorm; var_mean for the statistics (a Welford reduction, not vectorised)
    is five times slower than BatchNorm's kernel, as precise, and made a sample at 416 cost
    1.20x native compute (bench/group_bn_cost.py; 1.02x now)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, exchange: Exchange):
        # x: (b, C, H, W) or (b, C), this replica's samples
        channels = x.shape[1]
        count = torch.tensor([x.numel() / channels], dtype=torch.float64)  # on the host, for the wire
        if x.numel():
            mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)  # biased variance
            mean, m2 = mean.double(), var.double() * (x.numel() / channels)
        else:  # a replica with no samples in this micro-batch still takes part
            mean = m2 = torch.zeros(channels, dtype=torch.float64)
        parts = exchange("fwd", [count, to_host(mean), to_host(m2)])  # over the wire: from the host
        n = sum(p[0] for p in parts)
        gmean = sum(p[0] * p[1] for p in parts) / n
        gm2 = sum(p[2] + p[0] * (p[1] - gmean) ** 2 for p in parts)
        gvar = (gm2 / n).to(x.device, x.dtype)
        gmean = gmean.to(x.device, x.dtype)
        ctx.affine = weight is not None
        if weight is None:
            weight = torch.ones(channels, dtype=x.dtype, device=x.device)
        y = torch.batch_norm(x, weight, bias, gmean, gvar, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight, gmean, gvar)
        ctx.exchange, ctx.eps, ctx.n = exchange, eps, float(n)
        unbiased = (gm2 / max(float(n) - 1.0, 1.0)).to(x.device, x.dtype)
        count = torch.tensor(float(n), dtype=torch.float64)
        ctx.mark_non_differentiable(gmean, unbiased, gvar, count)
        return y, gmean, unbiased, gvar, count

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dgvar, _dcount):
        x, weight, gmean, gvar = ctx.saved_tensors
        if x.numel():  # with the group's mean and variance as "running" statistics: (dy w invstd, sum dy xhat, sum dy)
            # (also as the saved ones: CUDA's kernel reads those where its fused path does not apply)
            scaled, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy.contiguous(), x, weight, gmean, gvar, gmean, torch.rsqrt(gvar + ctx.eps), False, ctx.eps,
                [True, True, True])
        else:
            scaled = dy
            sum_dy_xhat = sum_dy = torch.zeros_like(weight)
        if not x.numel():
            _group_sums(ctx.exchange, sum_dy, sum_dy_xhat)
            return dy, *(_local_sums(ctx.affine, sum_dy_xhat, sum_dy)), None, None
        dx = _input_grad(ctx.exchange, scaled, x, weight, gmean, gvar, ctx.eps, ctx.n, sum_dy, sum_dy_xhat)
        return dx, *(_local_sums(ctx.affine, sum_dy_xhat, sum_dy)), None, None


def _group_sums(exchange: Exchange, sum_dy: torch.Tensor, sum_dy_xhat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's per-channel sums of dy and dy * xhat, from this replica's."""
    parts = exchange("bwd", [to_host(sum_dy.double()), to_host(sum_dy_xhat.double())])
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _local_sums(affine: bool, sum_dy_xhat: torch.Tensor, sum_dy: torch.Tensor):
    """The weight's and bias's gradients: this replica's partial sums (the step's all-reduce adds them up)."""
    return (sum_dy_xhat, sum_dy) if affine else (None, None)


def _input_grad(exchange: Exchange, scaled: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gmean: torch.Tensor,
                gvar: torch.Tensor, eps: float, n: float, sum_dy: torch.Tensor, sum_dy_xhat: torch.Tensor) -> torch.Tensor:
    """BatchNorm's input gradient from `scaled` (dy w invstd, overwritten with it) and this replica's sums,
    once the group's are known:
    dx = w invstd / n (n dy - sum dy - xhat sum(dy xhat)) = scaled - k (x - mean) - w invstd sum(dy) / n,
    with k = w invstd^2 sum(dy xhat) / n."""
    g_dy, g_dy_xhat = _group_sums(exchange, sum_dy, sum_dy_xhat)
    invstd = torch.rsqrt(gvar.double() + eps)
    w = weight.double()
    k = w * invstd * invstd * g_dy_xhat.to(w.device) / n
    shift = k * gmean.double() - w * invstd * g_dy.to(w.device) / n
    return scaled.addcmul_(x, _bc(-k.to(x.dtype), x)).add_(_bc(shift.to(x.dtype), x))


def _bc(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    shape = [1] * like.dim()
    shape[1] = -1
    return v.view(shape)


class GroupBatchNorm(nn.BatchNorm2d):
    """A drop-in for BatchNorm2d/1d with the same parameters, buffers and state_dict keys;
    `exchange` is set by the worker before each forward (it names the micro-batch)."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        self.weight, self.bias = bn.weight, bn.bias
        self.running_mean, self.running_var = bn.running_mean, bn.running_var
        self.num_batches_tracked = bn.num_batches_tracked
        self.exchange: Exchange | None = None
        self._group_stats: tuple[torch.Tensor, torch.Tensor, float] | None = None  # of the last training forward

    def _check_input_dim(self, x):  # 2-D (connected) and 4-D inputs alike
        if x.dim() not in (2, 4):
            raise ValueError(f"expected 2-D or 4-D input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.exchange is None:
            return super().forward(x)
        y, mean, var, biased, count = _GroupBatchNorm.apply(x, self.weight, self.bias, self.eps, self.exchange)
        self._group_stats = (mean.detach(), biased.detach(), float(count))
        with torch.no_grad():
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked + 1)
            self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(var, alpha=momentum)
            self.num_batches_tracked.add_(1)
        return y

    def recompute_output(self, x: torch.Tensor):
        """How to remake the last training forward's output for its input `x` (swarm.zoo.recompute):
        the same kernel with the group's statistics, which a plain BatchNorm could not find again
        from this replica's samples alone. None when the forward was a plain BatchNorm's."""
        if not self.training or self.exchange is None:
            return None
        mean, var, _ = self._group_stats
        weight, bias, eps = self.weight, self.bias, self.eps
        if weight is None:
            weight = torch.ones_like(mean)
        return lambda: torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)

    def streamed(self) -> "_GroupStream | None":
        """How a backward that runs a few channels at a time (swarm.zoo.recompute) remakes and
        back-propagates the last training forward: None when that was a plain BatchNorm's."""
        if not self.training or self.exchange is None:
            return None
        return _GroupStream(self.exchange, *self._group_stats, self.eps, self.weight is not None)


class _GroupStream:
    """The last group forward's statistics, for swarm.zoo.recompute's backward in runs of channels:
    each run remade and back-propagated by the kernels _GroupBatchNorm uses on the whole map (so
    the same numbers, bit for bit), the input gradient finished once the group's sums are in."""

    def __init__(self, exchange: Exchange, mean: torch.Tensor, var: torch.Tensor, n: float, eps: float, affine: bool):
        self.exchange, self.mean, self.var, self.n, self.eps, self.affine = exchange, mean, var, n, eps, affine

    def weight(self, weight: torch.Tensor | None) -> torch.Tensor:
        return weight if weight is not None else torch.ones_like(self.mean)

    def remake(self, c: torch.Tensor, weight, bias, j: int, k: int) -> torch.Tensor:
        return torch.batch_norm(c, weight, bias, self.mean[j:k], self.var[j:k], False, 0.0, self.eps, False)

    def backward(self, dy: torch.Tensor, c: torch.Tensor, weight, j: int, k: int):
        mean, var = self.mean[j:k], self.var[j:k]
        return torch.ops.aten.native_batch_norm_backward(dy, c, weight, mean, var, mean, torch.rsqrt(var + self.eps),
                                                         False, self.eps, [True, True, True])

    def finish(self, dc: torch.Tensor, c: torch.Tensor, weight, sum_dy_xhat: torch.Tensor, sum_dy: torch.Tensor):
        dc = _input_grad(self.exchange, dc, c, weight, self.mean, self.var, self.eps, self.n, sum_dy, sum_dy_xhat)
        return dc, *_local_sums(self.affine, sum_dy_xhat, sum_dy)


def replace_batchnorm(module: nn.Module) -> list[tuple[str, GroupBatchNorm]]:
    """Swap every BatchNorm in `module` for a GroupBatchNorm sharing its tensors; returns
    (qualified name, new module) pairs in forward order."""
    swapped = []
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and not isinstance(sub, GroupBatchNorm):
                new = GroupBatchNorm(sub)
                setattr(child, attr, new)
                swapped.append((f"{name}.{attr}" if name else attr, new))
    return swapped


# ---- running statistics of replicated stages -------------------------------------------
async def replay_running_stats(ep, step: int, p: int, stage, mine: list[int], ours: dict, modules,
                               timeout_s: float) -> None:
    """A replicated tiles stage: send our replica's BatchNorm batch statistics `ours`
    ({(micro-batch, layer): (mean, var, count)}) to the other replicas' devices (from the
    replica's first device), take theirs, and update the running statistics of `modules` with
    all of them in micro-batch order, as one device running every micro-batch would. `mine`:
    the stage's parts on this device."""
    own = stage.replica_of_part(mine[0])
    replicas = range(stage.replica_count())
    if stage.replica_tiles(own)[0] == ep.name and ours:
        keys = sorted(ours)
        records = [[m, layer, ours[(m, layer)][2], ours[(m, layer)][0].numel()] for m, layer in keys]
        flat = to_host(torch.cat([torch.cat([ours[k][0], ours[k][1]]) for k in keys]))
        for d in stage.devices:
            if d not in stage.replica_tiles(own):
                await ep.send(d, channels.bnstats(step, p, own), {"records": records, "arrays": [flat]})
    stats = dict(ours)
    for r in replicas:
        if r == own or not ours:
            continue
        msg = await ep.mailbox.get(channels.bnstats(step, p, r), timeout_s)
        flat, at = msg["arrays"][0], 0
        for m, layer, count, width in msg["records"]:
            stats[(m, layer)] = (flat[at:at + width], flat[at + width:at + 2 * width], count)
            at += 2 * width

    def apply() -> None:
        with torch.no_grad():
            for m, layer in sorted(stats):
                mean, var, count = stats[(m, layer)]
                where = modules[layer].bn.running_mean.device
                update_running_stats(modules[layer].bn, mean.to(where), var.to(where), count)
    await trio.to_thread.run_sync(apply)


async def merge_running_stats(ep, step: int, p: int, copy, moved: torch.Tensor, microbatches: int,
                              timeout_s: float, before: trio.Event | None = None) -> None:
    """A replicated single or dp stage: each replica's running statistics moved from zero over
    its micro-batches (`moved`, StageCopy.take_moved; alike on every device of a dp replica,
    whose group BatchNorm moves them together); gather them from all the stage's devices and
    combine one per replica with the step's starting statistics as the micro-batches in order
    would have moved them. The result is left in copy.start_stats, the next step's start: the
    next step may already be running, its additions counted from zero. `before`: the merge
    of the step before, which gives this step's start."""
    stage = copy.stage
    parts, shares = [], stage.replica_shares(microbatches)
    if moved.numel():
        gathered = await allgather(ep, stage.devices, channels.running(step, p), [moved], timeout_s)
        firsts = [stage.devices.index(stage.replica_devices(r)[0]) for r in range(stage.replica_count())]
        parts = [gathered[i][0] for i in firsts]
    if copy.in_turns:  # a row per micro-batch of each replica: all of them, in micro-batch order
        rows = [iter(part) for part in parts]
        parts = [next(rows[r]) for r in stage.replica_order(microbatches)] if parts else []
        shares = [1] * microbatches
    if before is not None:
        await before.wait()
    copy.start_stats = await trio.to_thread.run_sync(copy.merged_running, parts, shares)
