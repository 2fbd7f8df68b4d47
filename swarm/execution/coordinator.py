"""The coordinator's side of a training job: ship the starting weights, feed each step's
samples (uint8 images to the first stage, targets to the last), commit steps when every
device is ready, and collect the weights at the end into a local-format checkpoint.

Messages it receives: ("ready", step, device) and ("state", stage, device).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import trio

from swarm.data import class_targets, make_batch, microbatch_bounds, step_indices
from swarm.errors import SwarmError
from swarm.execution.blocks import cut
from swarm.execution.endpoint import Endpoint
from swarm.execution.routing import Block, Layout, stage_parts
from swarm.execution.worker import JobSpec
from swarm.trainer import LocalTrainer, set_lr


@dataclass
class StepReport:
    step: int  # 1-based count of finished steps
    loss: float
    seconds: float
    busy_s: dict[str, float] = field(default_factory=dict)
    times: dict[str, dict] = field(default_factory=dict)  # per device: schedule, reduce and wait seconds


def stage_state(full: dict[str, torch.Tensor], first: int, last: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in full.items() if first <= int(k.split(".")[1]) < last}


def optimizer_slots(trainer: LocalTrainer) -> dict[str, torch.Tensor]:
    """The local optimizer's per-parameter state as {"param name|slot": tensor}."""
    by_param = {id(p): n for n, p in trainer.net.named_parameters()}
    out = {}
    for param, st in trainer.optimizer.state.items():
        for slot, v in st.items():
            if torch.is_tensor(v):
                out[f"{by_param[id(param)]}|{slot}"] = v
    return out


def load_optimizer_slots(trainer: LocalTrainer, slots: dict[str, torch.Tensor]) -> None:
    params = dict(trainer.net.named_parameters())
    for key, value in slots.items():
        name, slot = key.split("|", 1)
        trainer.optimizer.state[params[name]][slot] = value.clone()


class TrainingCoordinator:
    def __init__(self, endpoint: Endpoint, job: JobSpec, trainer: LocalTrainer, train_set, layout: Layout):
        self.ep = endpoint
        self.job = job
        self.plan = job.plan
        self.trainer = trainer  # holds the whole model: the start, and the end result
        self.train_set = train_set
        self.layout = layout
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarm-feed")
        self.committed = trainer.step_count  # steps applied on every device
        self.should_stop = lambda: False  # asked after every commit: end the run there?
        self.stopped_early = False

    async def get(self, key):
        return await self.ep.mailbox.get(key, self.job.timeout_s)

    async def ship_initial_state(self) -> None:
        full, slots = await trio.to_thread.run_sync(
            lambda: ({k: v.detach().clone() for k, v in self.trainer.net.state_dict().items()},
                     optimizer_slots(self.trainer)))
        for p, stage in enumerate(self.plan.stages):
            state = stage_state(full, stage.first, stage.last)
            momentum = {k: v for k, v in slots.items() if stage.first <= int(k.split(".")[1]) < stage.last}
            for device in stage.devices:
                await self.ep.send(device, ("init", p), {"state": state, "momentum": momentum,
                                                         "step": self.trainer.step_count})

    def load_batch(self, step: int):
        cfg = self.trainer.cfg
        return make_batch(self.train_set, step_indices(len(self.train_set), cfg.batch_size, step, cfg.seed))

    async def feed(self, step: int, batch) -> None:
        images, targets = batch
        images = torch.from_numpy(images)
        if self.trainer.desc.loss == "region":
            targets = torch.from_numpy(targets)
        else:
            targets = torch.from_numpy(class_targets(targets))
        last = len(self.plan.stages) - 1
        for m, (lo, hi) in enumerate(microbatch_bounds(self.plan.batch_size, self.plan.microbatches)):
            mb = hi - lo
            whole = Block((0, mb))
            for holding in self.layout.inputs(0, mb):
                block = cut(images[lo:hi], whole, holding.block).contiguous()
                await self.ep.send(holding.part.device, ("feed", step, holding.part.index, m), {"arrays": [block]})
            for holding in self.layout.outputs(last, mb):
                s0, s1 = holding.block.samples
                await self.ep.send(holding.part.device, ("tgt", step, holding.part.index, m),
                                   {"arrays": [targets[lo + s0:lo + s1].contiguous()]})

    async def run(self, total_steps: int, on_step=None) -> None:
        """Train from the trainer's step to `total_steps`, then collect the weights into it."""
        devices = self.plan.used_devices()
        start = self.trainer.step_count
        await self.ship_initial_state()
        next_batch = await trio.to_thread.run_sync(self.load_batch, start) if start < total_steps else None
        for step in range(start, total_steps):
            t0 = time.monotonic()
            await self.feed(step, next_batch)
            if step + 1 < total_steps:  # load the next batch while this step runs
                pending = self.pool.submit(self.load_batch, step + 1)
            loss, busy, times = 0.0, {}, {}
            for device in devices:
                report = await self.get(("ready", step, device))
                loss += report["loss"]
                busy[device] = report["busy_s"]
                times[device] = report.get("times", {})
            if not np.isfinite(loss):
                raise SwarmError(f"the loss became {loss} at step {step + 1}; try a smaller --lr or a longer --warmup")
            stop_here = step + 1 < total_steps and self.should_stop()
            is_last = step + 1 == total_steps or stop_here
            for device in devices:
                await self.ep.send(device, ("decide", step), {"commit": True, "last": is_last})
            self.committed = step + 1
            if on_step is not None:
                on_step(StepReport(step + 1, loss, time.monotonic() - t0, busy, times))
            if stop_here:
                self.stopped_early = True
                break
            if step + 1 < total_steps:
                next_batch = await trio.to_thread.run_sync(pending.result)
        await self.collect()

    async def collect(self) -> None:
        """Fetch every stage's weights and optimizer state into the coordinator's model, which
        is then at the last committed step."""
        full = dict(self.trainer.net.state_dict())
        slots = {}
        for p, stage in enumerate(self.plan.stages):
            device = stage_parts(self.plan, p)[0].device
            await self.ep.send(device, ("get_state", p), {})
            msg = await self.get(("state", p, device))
            for k, v in msg["state"].items():
                full[k] = v
            slots.update(msg["momentum"])
        def load() -> None:  # in a thread: a big model takes a while, and heartbeats must go on
            self.trainer.net.load_state_dict(full)
            load_optimizer_slots(self.trainer, slots)
        await trio.to_thread.run_sync(load)
        self.trainer.step_count = self.committed
        if self.trainer.step_count > 0:  # as the local optimizer has it after its last step
            set_lr(self.trainer.optimizer, self.trainer.cfg.lr_at(self.trainer.step_count - 1))
        for device in self.plan.used_devices():
            await self.ep.send(device, ("stop",), {})
        self.pool.shutdown(wait=False)
