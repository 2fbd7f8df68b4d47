"""One device's copy of one stage: its layers, optimizer, and in-flight micro-batches.

The compute methods here run in a worker thread; they see only tensors and callables
(the group BatchNorm exchange), never sockets.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from planner.model_desc import ModelDesc
from planner.memory import recomputable
from planner.plan import Plan
from swarm.execution.group_bn import GroupBatchNorm, replace_batchnorm
from swarm.execution.threads import stop_if_cancelled
from swarm.local.compute_device import HOST, to_host
from swarm.local.trainer import TrainConfig, make_optimizer, optimizer_step, set_lr, torch_dtype
from swarm.zoo import build_model
from swarm.zoo.loss import make_loss


@dataclass
class InFlight:
    """What a forward keeps until its backward: input leaves, outputs, the loss."""

    leaves: dict[int, torch.Tensor]
    outputs: dict[int, torch.Tensor]
    loss: torch.Tensor | None = None


@dataclass
class StageCopy:
    """The weights of stage `p` on one device, shared by the device's parts of that stage."""

    plan: Plan
    p: int
    desc: ModelDesc
    cfg: TrainConfig
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    group_bns: list[tuple[str, GroupBatchNorm]] = field(default_factory=list)
    inflight: dict[tuple[int, int], InFlight] = field(default_factory=dict)  # (part, micro-batch)
    start_stats: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # replicas: the step's starting BN statistics
    tile_dy: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (tile, mb): dL/d(tile output)
    moved_by_mb: dict[int, torch.Tensor] = field(default_factory=dict)  # replicas in turn: each micro-batch's running stats
    device: torch.device = HOST  # where this copy computes; what it sends and keeps for others is on the host
    update_lock: threading.Lock = field(default_factory=threading.Lock)  # apply_params from several threads
    # layers with weights: open once the step before's update of them is applied (worker.Tail)
    gates: dict[int, threading.Event] = field(default_factory=dict)

    @classmethod
    def build(cls, plan: Plan, p: int, cfg: TrainConfig, cfg_text: str | None, group_size: int,
              device: torch.device = HOST) -> "StageCopy":
        stage = plan.stages[p]
        net, desc, _ = build_model(cfg.model, plan.img_size, cfg.classes, cfg_text=cfg_text,
                                   only=range(stage.first, stage.last))
        net.to(device, torch_dtype(cfg.dtype))
        net.train()
        group_bns = replace_batchnorm(net) if stage.mode == "dp" and group_size > 1 else []
        if stage.recompute:
            net.recompute = recomputable(desc) & set(range(stage.first, stage.last))
        net.checkpoint = bool(stage.checkpoint)
        for i in range(stage.first, stage.last):  # a cancelled job stops its forward at the next layer
            net.layers[i].register_forward_pre_hook(stop_if_cancelled)
        optimizer = make_optimizer(net.named_parameters(), cfg)
        gates = {i: threading.Event() for i in range(stage.first, stage.last)
                 if any(True for _ in net.layers[i].parameters())}
        for gate in gates.values():
            gate.set()
        return cls(plan, p, desc, cfg, net, optimizer, group_bns, device=device, gates=gates)

    @property
    def stage(self):
        return self.plan.stages[self.p]

    @property
    def is_last(self) -> bool:
        return self.p == len(self.plan.stages) - 1

    def state(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of this stage's layers (state_dict keys of the whole net), as
        copies in host memory."""
        return {k: v.detach().to(HOST, copy=True) for k, v in self.net.state_dict().items()}

    def momentum(self) -> dict[str, torch.Tensor]:
        """Optimizer state per parameter name (momentum buffers for SGD, moments for Adam)."""
        by_param = {id(p): n for n, p in self.net.named_parameters()}
        out = {}
        for param, st in self.optimizer.state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"{by_param[id(param)]}|{k}"] = v.detach().to(HOST, copy=True)
        return out

    def states(self) -> dict[str, torch.Tensor]:
        """Weights, buffers and optimizer slots ("name|slot") of this stage, as copies."""
        return {**self.state(), **self.momentum()}

    def load_states(self, states: dict[str, torch.Tensor]) -> None:
        """Load weights, buffers and optimizer slots (as `states()` gives them)."""
        own = self.net.state_dict()
        missing = [k for k in own if k not in states]
        if missing:
            raise ValueError(f"stage {self.p}: the state to start from lacks {missing[:3]}")
        self.net.load_state_dict({k: states[k] for k in own})
        params = dict(self.net.named_parameters())
        self.optimizer.state.clear()
        for key, value in states.items():
            if "|" in key:
                name, slot = key.split("|", 1)
                if name in params:
                    self.optimizer.state[params[name]][slot] = value.to(params[name].device, copy=True)

    # ---- BatchNorm running statistics of a replicated stage ----------------------------------
    def _batchnorms(self) -> list[torch.nn.modules.batchnorm._BatchNorm]:
        return [m for m in self.net.modules()
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

    def running_from_zero(self) -> None:
        """Before a step of a replica: keep the running statistics and start them from zero,
        so that the replica's micro-batches leave what they add alone."""
        self.start_stats = []
        for bn in self._batchnorms():
            if bn.momentum is None:
                raise ValueError("replicas need BatchNorm layers with a momentum (not a cumulative average)")
            self.start_stats.append((bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()))
            with torch.no_grad():
                bn.running_mean.zero_()
                bn.running_var.zero_()

    def running_moved(self) -> torch.Tensor:
        """What this replica's micro-batches added to the running statistics, in one vector."""
        bns = self._batchnorms()
        if not bns:
            return torch.zeros(0)
        return to_host(torch.cat([t.detach().reshape(-1) for bn in bns for t in (bn.running_mean, bn.running_var)]))

    def _kept_share(self) -> torch.Tensor:
        """1 - momentum for each value of running_moved's vector: what a micro-batch keeps of
        the running statistics before it."""
        return torch.cat([torch.full((2 * bn.running_mean.numel(),), 1.0 - bn.momentum, dtype=bn.running_mean.dtype)
                          for bn in self._batchnorms()]) if self._batchnorms() else torch.zeros(0)

    def _zero_running(self) -> None:
        with torch.no_grad():
            for bn in self._batchnorms():
                bn.running_mean.zero_()
                bn.running_var.zero_()

    @property
    def in_turns(self) -> bool:
        """A replicated stage whose replicas take the micro-batches in turn (Stage.deal)."""
        return self.stage.replica_count() > 1 and self.stage.deal == "turns"

    def take_moved(self) -> torch.Tensor:
        """After this device's last forward of a step: what the step's micro-batches added to
        the running statistics (running_moved), and the statistics back at zero for the next
        step's, which may start before this one's are merged. Replicas that take micro-batches
        in turn: what each of this device's micro-batches added alone, a row each in order."""
        if self.in_turns:
            rows = [self.moved_by_mb.pop(m) for m in sorted(self.moved_by_mb)]
            self._zero_running()
            return torch.stack(rows) if rows and rows[0].numel() else torch.zeros(0)
        moved = self.running_moved()  # a copy (a concatenation)
        self._zero_running()
        return moved

    def merged_running(self, moved: list[torch.Tensor], shares: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Running statistics after all the step's micro-batches, from the step's start
        (start_stats) and each replica's additions (in replica order; replica r ran shares[r]
        micro-batches): with a = 1 - momentum, what replica r added has decayed by a^k over the
        k micro-batches of the replicas after it, so the result is a^M start + sum_r
        a^(shares after r) moved_r. As start_stats are: (mean, var, count) per BatchNorm."""
        microbatches = sum(shares)
        offset, after = 0, []
        for bn, (mean0, var0, count0) in zip(self._batchnorms(), self.start_stats):
            a = 1.0 - bn.momentum
            n = bn.running_mean.numel()
            merged = []
            for start, at in ((mean0, offset), (var0, offset + n)):
                total = start.double() * a ** microbatches
                for r, part in enumerate(moved):
                    total += part[at:at + n].to(start.device).double().view_as(start) * a ** sum(shares[r + 1:])
                merged.append(total.to(start.dtype))
            after.append((*merged, count0 + microbatches))
            offset += 2 * n
        return after

    def set_running(self, stats: list[tuple[torch.Tensor, ...]]) -> None:
        """Write running statistics (as start_stats holds them) into the BatchNorm layers."""
        with torch.no_grad():
            for bn, (mean, var, count) in zip(self._batchnorms(), stats):
                bn.running_mean.copy_(mean)
                bn.running_var.copy_(var)
                bn.num_batches_tracked.copy_(count)

    # ---- compute (worker thread) ---------------------------------------------------------
    def forward(self, part: int, m: int, inputs: dict[int, torch.Tensor], keys: list[int],
                targets: torch.Tensor | None, batch_total: int, window=None) -> dict[int, torch.Tensor]:
        """Run the stage on one micro-batch; keep what backward needs; return the outputs, where
        the stage computes (the post brings them to the host for another device, once per
        message, and hands them over as they are to a stage on this device)."""
        stage = self.stage
        if targets is not None:
            targets = targets.to(self.device, self.net.dtype if targets.is_floating_point() else None,
                                 non_blocking=True)
        leaves = {}
        for k, t in inputs.items():  # from the host: one copy each to where this stage computes
            t = t.to(self.device, non_blocking=True)
            leaves[k] = t.detach().requires_grad_(True) if t.is_floating_point() and k >= 0 else t
        before = self.running_moved() if self.in_turns else None
        with torch.enable_grad():
            outs = self.net.forward_range(stage.first, stage.last, leaves, keys)
            if before is not None:  # what this micro-batch alone added (the buffers stay as autograd saw them)
                self.moved_by_mb[m] = self.running_moved() - self._kept_share() * before
            loss = None
            if self.is_last:
                out = self.desc.head_of(outs)
                loss_fn = make_loss(self.desc)
                loss = loss_fn(out, targets, batch_total, window) if window is not None else \
                    loss_fn(out, targets, batch_total)
        self.inflight[(part, m)] = InFlight(leaves, outs, loss)
        return {k: v.detach() for k, v in outs.items()}

    def tile_loss(self, tile: int, m: int, out: torch.Tensor, targets: torch.Tensor, batch_total: int,
                  window) -> float:
        """A tiles last stage: the loss on the tile's own output cells (its share of the
        whole map's loss), keeping dL/d(out) for the tile's backward."""
        y = out.detach().requires_grad_(True)  # (B, A*(5+C), h, w) on the tile's owned rect
        targets = targets.to(y.device, y.dtype if targets.is_floating_point() else None)
        with torch.enable_grad():
            loss = make_loss(self.desc)(y, targets, batch_total, window)
            loss.backward()
        self.tile_dy[(tile, m)] = y.grad
        return float(loss.detach())

    def loss_value(self, part: int, m: int) -> float:
        return float(self.inflight[(part, m)].loss.detach())

    def backward(self, part: int, m: int, grads: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor]:
        """Backward for one micro-batch; returns gradients of the stage's float inputs, where the
        stage computes (as the forward's outputs)."""
        held = self.inflight.pop((part, m))
        if self.is_last:
            held.loss.backward()
        else:
            tensors, grad_tensors = [], []
            for k, g in (grads or {}).items():
                out = held.outputs[k]
                if out.requires_grad:
                    tensors.append(out)
                    grad_tensors.append(g.to(out.device, non_blocking=True))
            if tensors:
                torch.autograd.backward(tensors, grad_tensors)
        return {k: leaf.grad for k, leaf in held.leaves.items()
                if k >= 0 and leaf.is_floating_point() and leaf.grad is not None}

    def flat_grads(self) -> torch.Tensor:
        """All parameter gradients in one vector (zeros where a parameter got none)."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.net.parameters()]) if any(True for _ in self.net.parameters()) \
            else torch.zeros(0)

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.net.parameters():
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def apply_params(self, step: int, params: list[torch.Tensor], commit: bool = True) -> None:
        """The optimizer's step for `params` alone (a bucket whose sum has arrived; or all of
        the stage's), at the step's learning rate: its groups cut down to them for the call,
        which steps each parameter as the whole step would. Their gradients are then dropped;
        a step not committed only drops them. Safe from several threads at once."""
        with self.update_lock:
            if commit:
                wanted = {id(q) for q in params}
                groups = self.optimizer.param_groups
                set_lr(self.optimizer, self.cfg.lr_at(step))
                self.optimizer.param_groups = [{**g, "params": [q for q in g["params"] if id(q) in wanted]}
                                               for g in groups]
                try:
                    optimizer_step(self.optimizer)
                finally:
                    self.optimizer.param_groups = groups
            for q in params:
                q.grad = None
