"""Training over the swarm runtime: the `train` job kind on agents, and endpoints that carry
keyed messages as JobData frames between agents and the coordinator.

Every execution message travels on the job channel "x" as {"k": key, "p": payload}; tensors
in the payload go as numpy arrays (raw bytes after the frame) and come back as torch
tensors that wrap the received buffers without a copy.
"""
from __future__ import annotations

import logging
from dataclasses import fields

import numpy as np
import torch
import trio

from planner.backups import Move
from planner.plan import Plan
from swarm.agent.lane import sum_lanes_on
from swarm.execution import channels
from swarm.execution.channels import COORDINATOR
from swarm.execution.lane import LANE, SumLanes
from swarm.execution.links import LINK_ERRORS, RunLinks, quick_limit
from swarm.execution.mailbox import Closed, Mailbox
from swarm.execution.replay import DeviceStore
from swarm.execution.worker import DeviceWorker, JobSpec
from swarm.host import malloc
from swarm.host.resources import compute_threads
from swarm.local.trainer import TrainConfig

CHANNEL = "x"

log = logging.getLogger("swarm.execution")


def to_wire(value):
    """Torch tensors to numpy arrays (C-contiguous), tuples to lists, recursively."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 tensors cannot travel; convert them first")
        return np.ascontiguousarray(t.cpu().numpy())
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    return value


def from_wire(value):
    """Numpy arrays back to torch tensors (sharing memory), recursively."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value


class WireEndpoint:
    """An Endpoint whose messages go through a send function (agent or coordinator side).

    `send_to(node_id, body)` sends one JobData body; `node_of` maps device names (and
    "coordinator") to node ids. Incoming messages whose key starts with a name in `routes`
    go to that function, (key, payload), instead of the mailbox."""

    def __init__(self, name: str, node_of: dict[str, str], send_to, routes: dict | None = None):
        self.name = name
        self.node_of = node_of
        self._send_to = send_to
        self.routes = routes or {}
        self.mailbox = Mailbox()
        self.bytes_sent = 0
        self.lanes = None  # gradient-sum lanes (swarm.execution.lane.SumLanes), where the run has them

    async def send(self, dst: str, key: tuple, payload: dict) -> None:
        if dst == self.name:  # a stage handing to another stage on this device: no copy
            await trio.lowlevel.checkpoint()
            self.mailbox.put(key, payload)
            return
        body = {"k": list(key), "p": to_wire(payload)}
        for a in body["p"].get("arrays", []) if isinstance(body["p"], dict) else []:
            self.bytes_sent += a.nbytes
        await self._send_to(self.node_of[dst], body)

    def deliver(self, body: dict) -> None:
        key = tuple(body["k"])
        route = self.routes.get(key[0]) if key else None
        if route is not None:
            route(key, from_wire(body["p"]))
        else:
            self.mailbox.put(key, from_wire(body["p"]))

    async def pump(self, receive) -> None:
        """Deliver everything `receive()` yields ((sender, JobData) pairs) into the mailbox."""
        while True:
            _, message = await receive()
            self.deliver(message.body)


def job_spec_dict(job: JobSpec, devices: dict[str, dict]) -> dict:
    """The spec each agent receives: the plan, the training config, where its layers come
    from, and who is who (name -> node id and address)."""
    return {"plan": job.plan.to_dict(), "cfg": job.cfg.to_dict(), "cfg_text": job.cfg_text, "devices": devices,
            "timeout_s": job.timeout_s, **job.spec_fields()}


# What each job's runs on this agent keep between epochs (a re-plan restarts the run; the
# layers it kept must survive that). One job at a time: a new job id clears the others.
STORES: dict[str, DeviceStore] = {}


def store_for(job_id: str) -> DeviceStore:
    for other in [j for j in STORES if j != job_id]:
        del STORES[other]
    return STORES.setdefault(job_id, DeviceStore())


def _train_config(d: dict) -> TrainConfig:
    known = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in d.items() if k in known})


def peers_of(plan: Plan, me: str) -> set[str]:
    """The devices `me` sends to in `plan`: those of its own stages (sums, BatchNorm, halos)
    and of the stages next to them (activations and gradients)."""
    mine = [p for p, stage in enumerate(plan.stages) if me in stage.devices]
    near = {q for p in mine for q in (p - 1, p, p + 1) if 0 <= q < len(plan.stages)}
    return {d for q in near for d in plan.stages[q].devices} - {me}


async def run_train_job(ctx) -> dict:
    """The `train` job kind: this agent's part of a plan, until the coordinator says stop."""
    spec = ctx.spec
    plan = Plan.from_dict(spec["plan"])
    cfg = _train_config(spec["cfg"])
    devices: dict[str, dict] = spec["devices"]  # name -> {"node_id", "address"}
    me = next(name for name, d in devices.items() if d["node_id"] == ctx.node_id)
    node_of = {name: d["node_id"] for name, d in devices.items()}
    node_of[COORDINATOR] = ctx.coordinator_id

    name_of = {node: name for name, node in node_of.items()}
    coordinator_lost = False

    async def report(name: str, why: str) -> None:
        await endpoint.send(COORDINATOR, channels.link(me, name), {"reason": why})

    links = RunLinks(devices, ctx.connect, report)
    quick_bytes = quick_limit(plan)

    async def send_to(node_id: str, body: dict) -> None:
        nonlocal coordinator_lost
        if node_id != ctx.coordinator_id:
            arrays = body["p"].get("arrays", []) if isinstance(body["p"], dict) else []
            await links.send(name_of[node_id], ctx.data(CHANNEL, body), sum(a.nbytes for a in arrays) < quick_bytes,
                             channels.send_priority(body["k"]))
            return
        try:
            await ctx.send_to_coordinator(ctx.data(CHANNEL, body))
        except LINK_ERRORS as exc:  # the coordinator sees its broken link itself, and re-plans
            if not coordinator_lost:
                coordinator_lost = True
                log.warning("cannot reach the coordinator (%s); dropping what goes to it", exc)

    endpoint = WireEndpoint(me, node_of, send_to)
    endpoint.lanes = SumLanes(me, devices, ctx.job_id, ctx.epoch, ctx.open_lane, lambda: ctx.receive(LANE), report) \
        if sum_lanes_on() else None
    job = JobSpec(plan, cfg, spec.get("cfg_text"), timeout_s=float(spec.get("timeout_s", 120.0)),
                  threads=compute_threads(), epoch=int(spec.get("epoch", 0)), start_step=int(spec.get("start_step", 0)),
                  moves=[Move.from_dict(m) for m in spec.get("moves", [])])
    store = store_for(ctx.job_id)
    log.info("job %s epoch %d: %.0f MiB resident, %.0f MiB of it snapshots and backups", ctx.job_id, ctx.epoch,
             resident_bytes() / 2**20, store.nbytes() / 2**20)
    if not plan.mapped:
        need = planned_peak(plan, cfg, spec.get("cfg_text"), me)
        reserved = await trio.to_thread.run_sync(malloc.reserve, need) if need else 0
        if reserved:
            log.info("job %s epoch %d: %.0f MiB of heap faulted in before the first step (the plan predicts "
                     "%.0f MiB at a step's peak)", ctx.job_id, ctx.epoch, reserved / 2**20, need / 2**20)
    if malloc.map_large(plan.mapped):  # (planner.mapping: the plan was made for devices that can)
        log.info("job %s epoch %d: blocks of %d MiB or more mapped afresh", ctx.job_id, ctx.epoch,
                 malloc.MAPPED_FROM >> 20)
    worker = DeviceWorker(endpoint, job, store)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(endpoint.pump, lambda: ctx.receive(CHANNEL))
            nursery.start_soon(links.watch)
            nursery.start_soon(links.open_to, sorted(peers_of(plan, me) & set(devices)))
            if endpoint.lanes is not None:
                nursery.start_soon(endpoint.lanes.pump)
            await worker.run()
            nursery.cancel_scope.cancel()
    finally:
        malloc.map_large(False)
        if endpoint.lanes is not None:
            await endpoint.lanes.aclose()
        await links.aclose()
        endpoint.mailbox.close(Closed("the run ended"))
        trio.lowlevel.spawn_system_task(release_memory_soon)  # once this run's traceback lets go of it
    STORES.pop(ctx.job_id, None)  # the job is over
    return {"device": me, "busy_s": worker.busy_s, "bytes_sent": endpoint.bytes_sent}


def planned_peak(plan: Plan, cfg: TrainConfig, cfg_text: str | None, me: str) -> int:
    """What the plan predicts `me` holds at a step's peak, the runtime included (what
    `swarm train` prints under its plan), where the planner simulated it; else 0."""
    from planner.memory_fit import room_left
    from swarm.zoo import describe_model

    try:
        desc = describe_model(cfg.model, plan.img_size, cfg.classes, cfg_text)
    except Exception:  # noqa: BLE001 (the worker says what is wrong with the model, in its own words)
        return 0
    need, have, predicted = room_left(plan, desc, cfg.optimizer).get(me, (0.0, 0.0, False))
    return int(min(need, have)) if predicted else 0


def resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


RELEASE_AFTER_S = 1.0


async def release_memory_soon() -> None:
    """Return the ended run's memory (swarm.host.malloc keeps freed pages for reuse) shortly
    after it ends: not at once, since a cancelled run's traceback holds it until the
    cancellation has gone by. (A newer epoch's run does not wait for this: the agent starts it
    only once the older run has ended and its memory is back.)"""
    await trio.sleep(RELEASE_AFTER_S)
    await trio.to_thread.run_sync(malloc.release)
