"""`swarm train` across the swarm: find the devices, make (or read) the plan, start the
`train` job on every agent in it, coordinate the steps, and bring the weights home.

If no other device answers, the run stays on this machine (the local trainer).
"""
from __future__ import annotations

import os
import signal
import socket
import uuid
from dataclasses import dataclass

import trio

from planner.plan import Plan, PlanError
from swarm.errors import SwarmError
from swarm.execution.coordinator import StepReport, TrainingCoordinator
from swarm.execution.job import CHANNEL, WireEndpoint, job_spec_dict
from swarm.execution.routing import Layout
from swarm.execution.strategies import simple_plan
from swarm.execution.tiling import TileGeometry
from swarm.execution.worker import COORDINATOR, JobSpec


@dataclass
class SwarmOptions:
    strategy: str = "auto"  # auto | dp | pp | tiles | hybrid | plan
    plan_path: str | None = None
    grid: tuple[int, int] | None = None
    sync: str | None = None
    stages: int | None = None
    devices: int | None = None  # use this many devices (default: whoever answers in `wait_s`)
    schedule: str = "1f1b"  # or "gpipe": all forwards of a step, then all backwards
    wait_s: float = 2.0
    interface: str | None = None
    peers: str | None = None
    state_dir: str | None = None
    token_file: str | None = None
    timeout_s: float = 600.0  # longest wait for one message before a worker gives up
    heartbeat_s: float = 0.25  # heartbeat interval asked of the agents
    suspect_after_s: float = 2.0  # silence that makes a device suspect (a killed agent's link breaks at once)
    probe_timeout_s: float = 2.0  # how long a suspect device has to answer a probe


def unique_names(devices) -> dict[str, object]:
    """Device name -> Device, names made unique with a piece of the node id when needed."""
    counts: dict[str, int] = {}
    for d in devices:
        counts[d.name] = counts.get(d.name, 0) + 1
    return {(d.name if counts[d.name] == 1 else f"{d.name}-{d.node_id[:6]}"): d for d in devices}


def own_addresses() -> set[str]:
    import psutil

    found = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                found.add(a.address.split("%")[0])
    return found


class SwarmRunner:
    """run_steps for swarm.trainer.train: the steps run on the devices of the swarm."""

    def __init__(self, options: SwarmOptions, log, fallback):
        self.options = options
        self.log = log
        self.fallback = fallback  # run_steps to use when no other device is found
        self.plan: Plan | None = None
        self.stopping = False

    def __call__(self, trainer, train_set, start: int, total: int, report) -> None:
        from swarm.commands.runtime_common import run_trio

        went_local = run_trio(self._main, trainer, train_set, start, total, report)
        if went_local:
            self.fallback(trainer, train_set, start, total, report)

    async def _main(self, trainer, train_set, start: int, total: int, report) -> bool:
        from swarm.agent import DEFAULT_PORT
        from swarm.cluster import open_cluster
        from swarm.net import Credentials, parse_peers, resolve_network
        from swarm.state import find_token, process_id, state_dir_from

        o = self.options
        state_dir = state_dir_from(o.state_dir)
        try:
            token, _ = find_token(o.token_file, state_dir, create=False)
        except SwarmError as exc:
            if o.strategy == "auto":
                self.log("no cluster token on this machine (run `swarm join` or set SWARM_TOKEN); training here")
                return True
            raise SwarmError(f"--strategy {o.strategy} runs on devices running `swarm join`, and this machine has "
                             f"no cluster token to reach them ({exc}); add --in-process to try it on this machine "
                             "alone") from None
        network = resolve_network(o.interface)
        peers = parse_peers(o.peers or os.environ.get("SWARM_PEERS"), DEFAULT_PORT)
        credentials = Credentials(process_id(state_dir), token)
        # Training devices are busy: a heartbeat may come late without the device being gone.
        async with open_cluster(credentials, network, peers=peers, heartbeat_interval=o.heartbeat_s,
                                suspect_after=o.suspect_after_s, probe_timeout=o.probe_timeout_s) as cluster:
            found = await self._find(cluster)
            if not found:
                if o.strategy == "auto":
                    self.log("no other device found; training on this machine")
                    return True
                raise SwarmError(f"--strategy {o.strategy} runs on devices running `swarm join`, and none answered "
                                 f"within {o.wait_s:g} s (check the token and the network, use --peers, or add "
                                 "--in-process to try it on this machine alone)")
            names = unique_names(found)
            plan = self._make_plan(trainer, list(names), names)
            self.plan = plan
            self.log(describe_plan(plan))
            await self._run_job(cluster, names, plan, trainer, train_set, total, report)
        return False

    async def _find(self, cluster) -> list:
        o = self.options
        self.log(f"looking for devices ({o.wait_s:g} s)..." if not o.devices else
                 f"waiting for {o.devices} devices (up to {o.wait_s:g} s)...")
        if o.devices:
            devices = await cluster.wait_for(o.devices, timeout=o.wait_s)
            if len(devices) < o.devices:
                raise SwarmError(f"only {len(devices)} of {o.devices} devices answered within {o.wait_s:g} s: "
                                 f"{', '.join(d.name for d in devices) or 'none'}")
            devices = sorted(devices, key=lambda d: (d.name, d.node_id))[:o.devices]
        else:
            await trio.sleep(o.wait_s)
            devices = cluster.alive()
        if o.strategy == "auto" and len(devices) == 1 and devices[0].address in own_addresses():
            return []  # only this machine's own agent: no other device
        return devices

    def _make_plan(self, trainer, names: list[str], devices: dict) -> Plan:
        o = self.options
        cfg, desc = trainer.cfg, trainer.desc
        facts = {n: {"cores": d.cores, "memory": d.memory, "address": f"{d.address}:{d.port}"} for n, d in devices.items()}
        if o.plan_path:
            try:
                text = open(o.plan_path).read()
            except OSError as exc:
                raise SwarmError(f"cannot read plan {o.plan_path}: {exc.strerror or exc}") from None
            plan = Plan.from_json(text)
            missing = [d for d in plan.used_devices() if d not in devices]
            if missing:
                raise SwarmError(f"the plan uses {', '.join(missing)}, which did not answer; found: {', '.join(names)}")
            if (plan.batch_size, plan.microbatches) != (cfg.batch_size, cfg.microbatches):
                raise SwarmError(f"the plan is for batch {plan.batch_size} in {plan.microbatches} micro-batches; "
                                 f"give --batch-size {plan.batch_size} --microbatches {plan.microbatches}")
            plan.devices = {d: facts[d] for d in plan.used_devices()}
        elif o.strategy == "auto":
            plan = self._auto_plan(trainer, names, facts)
        else:
            plan = simple_plan(o.strategy, desc, names, cfg.batch_size, cfg.microbatches, grid=o.grid, sync=o.sync,
                               stages=o.stages, facts=facts)
        if o.schedule == "gpipe":  # every stage runs all forwards first (for comparison)
            for stage in plan.stages:
                stage.warmup = plan.microbatches
        plan.validate(desc)
        return plan

    def _auto_plan(self, trainer, names: list[str], facts: dict) -> Plan:
        """Without profiles of the devices, `auto` splits like `tiles` when the network starts
        with tileable layers, else like `pp`."""
        from tiles.layout import tileable_prefix

        cfg, desc = trainer.cfg, trainer.desc
        strategy = "tiles" if tileable_prefix(desc) > 0 else "pp"
        return simple_plan(strategy, desc, names, cfg.batch_size, cfg.microbatches, facts=facts)

    async def _run_job(self, cluster, names: dict, plan: Plan, trainer, train_set, total: int, report) -> None:
        o = self.options
        used = plan.used_devices()
        devices = {n: {"node_id": names[n].node_id, "address": f"{names[n].address}:{names[n].port}"} for n in used}
        node_of = {n: d["node_id"] for n, d in devices.items()}
        name_of = {v: k for k, v in node_of.items()}
        job = cluster.job(f"train-{uuid.uuid4().hex[:8]}", epoch=0)
        spec = job_spec_dict(plan, trainer.cfg, trainer.cfg_text, devices, o.timeout_s)
        node_of[COORDINATOR] = cluster.credentials.node_id

        async def send_to(node_id: str, body: dict) -> None:
            await job.send(node_id, job.data(CHANNEL, body))

        endpoint = WireEndpoint(COORDINATOR, node_of, send_to)
        events = cluster.subscribe()
        try:
            for n in used:
                await job.assign(node_of[n], "train", spec)
            for n in used:
                await job.start(node_of[n])
            coordinator = TrainingCoordinator(endpoint, JobSpec(plan, trainer.cfg, trainer.cfg_text, o.timeout_s),
                                              trainer, train_set, Layout(plan, trainer.desc, TileGeometry(plan, trainer.desc)))
            coordinator.should_stop = lambda: self.stopping

            def on_step(r: StepReport) -> None:
                util = "/".join(f"{100 * r.busy_s.get(n, 0.0) / max(r.seconds, 1e-9):.0f}" for n in used)
                report(r.step, r.loss, plan.batch_size, r.seconds, f"  util {util}%",
                       {"utilisation": {n: r.busy_s.get(n, 0.0) / max(r.seconds, 1e-9) for n in used},
                        "device_times": {n: {"busy_s": r.busy_s.get(n, 0.0), **r.times.get(n, {})} for n in used}})

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(endpoint.pump, lambda: job.receive(CHANNEL))
                    nursery.start_soon(self._watch_members, events, set(node_of.values()), name_of, coordinator)
                    nursery.start_soon(self._watch_signals)
                    await coordinator.run(total, on_step)
                    nursery.cancel_scope.cancel()
            except (Exception, BaseExceptionGroup) as exc:
                if isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None:
                    raise
                gone = [(n, cluster.device(node_of[n])) for n in used]
                gone = [(n, d.health if d else "gone") for n, d in gone if d is None or d.health != "alive"]
                if gone:
                    who = ", ".join(f"{n} ({h})" for n, h in gone)
                    raise SwarmError(f"lost {who} during step {coordinator.committed + 1}; training stopped after "
                                     f"step {coordinator.committed} (nothing was saved: the devices held the "
                                     "weights)") from None
                raise
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(10):
                    try:
                        await job.release_all()
                    except SwarmError:
                        pass  # a device that is gone has nothing to release
        if coordinator.stopped_early:
            raise KeyboardInterrupt

    async def _watch_members(self, events, nodes: set[str], name_of: dict, coordinator) -> None:
        async for event in events:
            if event.node_id in nodes and event.kind in ("dead", "left"):
                raise SwarmError(f"lost {name_of.get(event.node_id, event.node_id)} ({event.kind}: "
                                 f"{event.reason or 'no answer'}) during step {coordinator.committed + 1}; training "
                                 f"stopped after step {coordinator.committed} (nothing was saved: the devices held "
                                 "the weights)")

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if self.stopping:
                    raise KeyboardInterrupt  # a second Ctrl-C: stop now
                self.stopping = True
                self.log("stopping after this step (Ctrl-C again to stop at once)")


def describe_plan(plan: Plan) -> str:
    lines = [f"plan ({plan.planner}): {len(plan.stages)} stage(s), {len(plan.used_devices())} device(s), "
             f"batch {plan.batch_size} in {plan.microbatches} micro-batch(es)"]
    for i, s in enumerate(plan.stages):
        how = s.mode
        if s.mode == "tiles":
            how += f" {s.grid[0]}x{s.grid[1]}"
        elif s.mode == "dp":
            how += " " + ",".join(f"{d}:{n}" for d, n in s.allocation.items())
        lines.append(f"  stage {i}: layers {s.first}-{s.last - 1} {how} on {', '.join(s.devices)}")
    return "\n".join(lines)


__all__ = ["SwarmOptions", "SwarmRunner", "describe_plan", "PlanError"]
