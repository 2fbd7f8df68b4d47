"""`swarm train` across the swarm: find the devices, make (or read) the plan, start the
`train` job on every agent in it, coordinate the steps, and bring the weights home.

If no other device answers, the run stays on this machine (the local trainer).
"""
from __future__ import annotations

import itertools
import math
import os
import signal
import socket
import uuid
from dataclasses import dataclass

import trio

from planner.baselines import simple_plan
from planner.memory_fit import describe as describe_overflows
from planner.memory_fit import describe_room, memory_overflows, room_left
from planner.plan import Plan, PlanError
from swarm.agent import DEFAULT_PORT
from swarm.agent.failover import Replica, first_epoch, term_of
from swarm.agent.quorum import LEASE_ASK_S, LEASE_S, Lease
from swarm.cluster import JobError, open_roster
from swarm.cluster.membership import BUSY_PROBE_TIMEOUT, BUSY_SUSPECT_AFTER
from swarm.errors import SwarmError, run_trio
from swarm.execution.channels import COORDINATOR, LINK
from swarm.execution.coordinator import StepReport, TrainingCoordinator
from swarm.execution.replay import MISSING_HOLDING
from swarm.execution.train_job import CHANNEL, WireEndpoint, job_spec_dict
from swarm.execution.worker import JobSpec
from swarm.host.state import find_token, process_id, state_dir_from
from swarm.local.checkpoint import save_checkpoint
from swarm.local.compute_device import HOST
from swarm.local.trainer import SAVE_EVERY_S
from swarm.net import ConnectionLost, Credentials, parse_endpoint, parse_peers, resolve_network
from swarm.profiling.bandwidth import measure_bandwidth
from swarm.profiling.profiler import CANNOT_PROFILE, profile_devices
from swarm.profiling.survey import offered_accelerators
from swarm.wire import JobReplica, LeaseAnswer, LeaseAsk
from swarm.zoo import BUILTIN
from tiles.layout import tileable_prefix

# After a stop signal, how long the step under way may take to commit, and then its weights to
# come back, before the run stops without them.
STOP_GRACE_S = 5.0
RELEASE_S = 3.0  # how long the devices have to confirm they let go of the job at the end
LINK_WATCH_S = 0.2  # how often the coordinator looks at its connections to the epoch's devices
REPLICA_WAIT_S = 10.0  # how long a successor waits for the devices of the run it takes over
# A device on a small CPU share can miss a probe while it profiles (a 0.1-core device did, and
# a run planned by FLOPs alone was killed for memory); it is back at its next heartbeat, and
# its profile is cached by then, so measuring again is cheap.
MEASURE_TRIES = 3
MEASURE_RETRY_WAIT_S = 10.0


@dataclass
class SwarmOptions:
    strategy: str = "auto"  # auto | dp | pp | tiles | hybrid | plan
    plan_path: str | None = None
    grid: tuple[int, int] | None = None
    sync: str | None = None
    stages: int | None = None
    together: int | None = None  # tiles: micro-batches run as one block (default: as many as fit)
    replicas: int | None = None  # tiles, dp: copies of the stage running different micro-batches at once
    devices: int | None = None  # use this many devices (default: whoever answers in `wait_s`)
    schedule: str = "1f1b"  # or "gpipe": all forwards of a step, then all backwards
    wait_s: float = 2.0
    interface: str | None = None
    peers: str | None = None
    state_dir: str | None = None
    token_file: str | None = None
    timeout_s: float = 600.0  # longest wait for one message before a worker gives up
    heartbeat_s: float = 0.25  # heartbeat interval asked of the agents
    suspect_after_s: float = BUSY_SUSPECT_AFTER  # silence that makes a device suspect
    probe_timeout_s: float = BUSY_PROBE_TIMEOUT  # how long a suspect device has to answer a probe
    backup_interval: int = 0  # devices back up their stages every this many steps; 0: by time
    checkpoint_every: int = 25  # the coordinator collects the weights and saves every this many steps
    save_path: str | None = None
    local_save_every: int = 0  # --save-every when the run stays on this machine
    recovery: str = "auto"  # after a lost device: auto | light | heavy (see TrainingCoordinator)
    recost: bool = True  # auto: plan again on the devices' measured speeds after the first steps (planner/recost.py)
    run_id: str | None = None  # a detached run's id: its state is replicated to the agents (failover.py)
    take_over: str | None = None  # a lost coordinator's replica (a JSON file): carry its run on
    run_flags: list[str] | None = None  # the detached run's `swarm train` flags, for the replica


def unique_names(devices) -> dict[str, object]:
    """Device name -> Device; a name two devices share gets its address (as `swarm plan`
    names them, so its plans can be run as they are)."""
    names: dict[str, object] = {}
    for d in devices:
        names[d.name if d.name not in names else f"{d.name}@{d.address}"] = d
    return names


def own_addresses() -> set[str]:
    import psutil

    found = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                found.add(a.address.split("%")[0])
    return found


def prediction_line(plan: Plan, measured: bool) -> str | None:
    """What the planner expects of `plan`, as `swarm train` prints it under the plan: on the
    devices' profiles, or on estimates where they could not be measured; None for a plan
    that was not simulated (the fallback when no planner's plan fits)."""
    predicted = plan.predicted or {}
    if "throughput" not in predicted:
        return None
    return (f"predicted {'on the profiles' if measured else 'on estimates'}: {predicted['throughput']:.3f} samples/s, "
            f"{predicted['step_time_s']:.2f} s a step")


class SwarmRunner:
    """run_steps for swarm.local.trainer.train: the steps run on the devices of the swarm."""

    def __init__(self, options: SwarmOptions, log, fallback):
        self.options = options
        self.log = log
        self.fallback = fallback  # run_steps to use when no other device is found
        self.plan: Plan | None = None
        self.coordinator: TrainingCoordinator | None = None
        self.recost_inputs = None  # (PlanInputs, facts) of an auto plan: re-costed from the first steps' measures
        self.stopping = False  # a stop signal came: end the run after the step under way
        self.interrupted = False  # the run was cut short without waiting for a step
        self.run_scope = trio.CancelScope()  # the whole run, cancelled when a stop cannot wait
        self.stop_deadline = math.inf  # when the run is cut short if it has not stopped by itself

    def __call__(self, trainer, train_set, start: int, total: int, report) -> None:
        went_local = run_trio(self._main, trainer, train_set, start, total, report)
        if went_local:
            report.save_every = self.options.local_save_every
            report.save_every_s = SAVE_EVERY_S
            self.fallback(trainer, train_set, start, total, report)

    async def _main(self, trainer, train_set, start: int, total: int, report) -> bool:
        """The run across the swarm, ended early by a stop signal (KeyboardInterrupt); True
        if no other device is found and the run should stay on this machine."""
        went_local = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals)
            with self.run_scope:
                went_local = await self._discover_and_run(trainer, train_set, start, total, report)
            nursery.cancel_scope.cancel()
        if self.interrupted or (self.coordinator is not None and self.coordinator.stopped_early):
            raise KeyboardInterrupt
        return went_local

    async def _discover_and_run(self, trainer, train_set, start: int, total: int, report) -> bool:
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
        async with open_roster(credentials, network, peers=peers, heartbeat_interval=o.heartbeat_s,
                                suspect_after=o.suspect_after_s, probe_timeout=o.probe_timeout_s) as cluster:
            if o.take_over:
                replica = read_replica(o.take_over)
                names = await self._find_replica_devices(cluster, replica)
                self.plan = Plan.from_dict(replica.plan)
                self.log(f"taking over run {replica.run_id} from its lost coordinator (term {replica.next_term}) at the "
                         f"backup of step {replica.step}, with {', '.join(sorted(names)) or 'no device'}")
                await self._run_job(cluster, names, self.plan, trainer, train_set, total, report, replica)
                return False
            found = await self._find(cluster)
            if not found:
                if o.strategy == "auto":
                    self.log("no other device found; training on this machine")
                    return True
                raise SwarmError(f"--strategy {o.strategy} runs on devices running `swarm join`, and none answered "
                                 f"within {o.wait_s:g} s (check the token and the network, use --peers, or add "
                                 "--in-process to try it on this machine alone)")
            names = unique_names(found)
            measured = await self._measure(cluster, trainer, found) if o.strategy == "auto" and not o.plan_path \
                else None
            await cluster.refresh([d.node_id for d in found])  # what each can spare now, after any profiling
            if measured is not None:
                measured["devices"] = [d.as_dict() for d in found]
            plan = self._make_plan(trainer, list(names), names, measured)
            self.plan = plan
            self.log(plan.describe())
            room = describe_room(room_left(plan, trainer.desc, trainer.cfg.optimizer))
            if room:
                self.log(room)
            line = prediction_line(plan, measured is not None) if o.strategy == "auto" and not o.plan_path else None
            if line:
                self.log(line)
            await self._run_job(cluster, names, plan, trainer, train_set, total, report)
        return False

    async def _find_replica_devices(self, cluster, replica: Replica) -> dict:
        """Name -> Member of the replica's devices that answer: reached at their addresses, and
        waited for (all but the lost coordinator's) up to REPLICA_WAIT_S."""
        for d in replica.devices.values():
            host, port = parse_endpoint(d["address"], DEFAULT_PORT)
            cluster.add_endpoint(host, port, node_id=d["node_id"])
        wanted = {n for n, d in replica.devices.items() if d["node_id"] != replica.coordinator}

        def answering() -> dict:
            return {n: cluster.device(node) for n, node in replica_nodes(replica).items()
                    if cluster.device(node) is not None and cluster.device(node).health == "alive"}
        with trio.move_on_after(REPLICA_WAIT_S):
            while not wanted <= set(answering()):
                await trio.sleep(0.1)
        return answering()

    async def _find(self, cluster) -> list:
        o = self.options
        self.log(f"looking for devices ({o.wait_s:g} s)..." if not o.devices else
                 f"waiting for {o.devices} devices (up to {o.wait_s:g} s)...")
        if o.devices:
            devices = await cluster.wait_for(o.devices, timeout=o.wait_s)
            if len(devices) < o.devices:
                strangers = cluster.strangers()
                raise SwarmError(f"only {len(devices)} of {o.devices} devices answered within {o.wait_s:g} s: "
                                 f"{', '.join(d.name for d in devices) or 'none'}"
                                 + (f" ({strangers})" if strangers else ""))
            devices = sorted(devices, key=lambda d: (d.name, d.node_id))[:o.devices]
        else:
            await trio.sleep(o.wait_s)
            devices = cluster.alive()
        if o.strategy == "auto" and len(devices) == 1 and devices[0].address in own_addresses():
            return []  # only this machine's own agent: no other device
        return devices

    async def _measure(self, cluster, trainer, devices) -> dict | None:
        """Profiles of the devices (a job on each, cached there) and the links between them,
        for the planner; None if that fails (the run then splits by FLOPs)."""
        cfg = trainer.cfg
        spec = {"model": cfg.model, "img_size": trainer.desc.img_size.to_json(), "classes": cfg.classes,
                "cfg": None if cfg.model in BUILTIN else trainer.cfg_text, "threads": None}
        self.log(f"profiling {len(devices)} device(s) (cached on each after the first time) and measuring the links")
        ids = [d.node_id for d in devices]
        for attempt in range(1, MEASURE_TRIES + 1):
            try:
                profiles = await profile_devices(cluster, ids, spec, accelerators=offered_accelerators(devices))
                links = await measure_bandwidth(cluster, ids) if len(ids) > 1 else {}
                break
            except SwarmError as exc:
                # a device that cannot measure the model even in pieces will not manage the next time either
                if CANNOT_PROFILE in str(exc) or attempt == MEASURE_TRIES:
                    self.log(f"could not profile the devices ({exc}); planning on estimates instead")
                    return None
                self.log(f"could not profile the devices ({exc}); trying again")
                await cluster.wait_for(len(ids), timeout=MEASURE_RETRY_WAIT_S)
            except trio.TooSlowError as exc:
                self.log(f"could not profile the devices ({exc or 'no answer in time'}); planning on estimates instead")
                return None
        return {"devices": [d.as_dict() for d in devices], "profiles": profiles, "links": links}

    def _make_plan(self, trainer, names: list[str], devices: dict, measured: dict | None = None) -> Plan:
        o = self.options
        cfg, desc = trainer.cfg, trainer.desc
        from swarm.profiling.survey import plan_memory

        # memory: what each device could spare when asked (swarm/host/resources.py), which plans count on
        facts = {n: {"cores": d.cores, "memory": plan_memory(vars(d)), "address": f"{d.address}:{d.port}"}
                 for n, d in devices.items()}
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
            plan.devices = {d: dict(facts[d], **_accelerator_fact(plan, d, devices[d])) for d in plan.used_devices()}
        elif o.strategy == "auto":
            plan = self._auto_plan(trainer, names, facts, measured)
        else:
            plan = simple_plan(o.strategy, desc, names, cfg.batch_size, cfg.microbatches, grid=o.grid, sync=o.sync,
                               stages=o.stages, facts=facts, together=o.together,
                               replicas=o.replicas)
        if o.schedule == "gpipe":  # every stage runs all forwards first (for comparison)
            for stage in plan.stages:
                stage.warmup = plan.microbatches
        try:
            plan.validate(desc)
            short = memory_overflows(plan, desc, {n: f.get("memory") for n, f in facts.items()}, cfg.optimizer)
        except PlanError as exc:
            raise SwarmError(f"the plan cannot run: {exc}") from None
        if short:
            raise SwarmError(f"the plan does not fit in the devices' memory: {describe_overflows(short)} (less than "
                             f"the devices would need; --strategy auto plans within each device's memory, and a "
                             f"smaller --img-size or more --microbatches needs less)")
        return plan

    def _auto_plan(self, trainer, names: list[str], facts: dict, measured: dict | None) -> Plan:
        """The best predicted of the planners on the measured devices. Without measurements
        (a device could not profile the model, or profiling failed), the best on estimates
        (swarm.profiling.survey.estimated_cluster: compute by cores, nominal links), which
        still plans within each device's memory; failing that, tiles when the network starts
        with tileable layers, else a pipeline."""
        from planner.inputs import PlanInputs
        from planner.memory import MemoryModel, plan_allocator
        from planner.planners import make_plan
        from swarm.profiling.survey import cluster_from_live, estimated_cluster

        cfg, desc = trainer.cfg, trainer.desc
        try:
            if measured is not None:
                cluster = cluster_from_live(measured, desc)
                profile = next(iter(measured["profiles"].values()))
                mem = MemoryModel.for_devices(desc, cfg.optimizer, profile.act_bytes,
                                              plan_allocator(d.facts.get("allocator") for d in cluster.devices))
            else:
                cluster = estimated_cluster({n: facts[n] for n in names}, desc)
                mem = MemoryModel.estimated(desc, cfg.optimizer)
            inputs = PlanInputs(desc, mem, cluster, cfg.batch_size, cfg.microbatches)
            plan = self._with_facts(make_plan("auto", inputs), cluster, facts)
            if measured is not None:  # (re-costing compares measured compute with a profile's)
                self.recost_inputs = (inputs, facts)
            if plan.predicted and not plan.predicted.get("fits", True):
                self.log("warning: the planner predicts this plan does not fit in the devices' memory")
            return plan
        except (PlanError, SwarmError, ValueError) as exc:
            self.log(f"the planner could not plan these devices ({exc}); splitting by FLOPs instead")
        strategy = "tiles" if tileable_prefix(desc) > 0 else "pp"
        return simple_plan(strategy, desc, names, cfg.batch_size, cfg.microbatches, facts=facts)

    @staticmethod
    def _with_facts(plan: Plan, cluster, facts: dict) -> Plan:
        """What the runtime reads of the plan's devices: their facts, and the accelerator the
        planner put a device's layers on."""
        on = {d.name: {"accelerator": d.accelerator.kind} for d in cluster.devices if d.accelerator}
        plan.devices = {n: dict(facts.get(n, {}), **on.get(n, {})) for n in plan.used_devices()}
        return plan

    def _recoster(self):
        """For the coordinator: the plan re-costed on the devices' measured compute
        (planner/recost.py), with the facts the runtime reads."""
        from planner.recost import recost

        inputs, facts = self.recost_inputs

        def run(plan: Plan, measured: dict, alive: list[str]):
            result = recost(plan, inputs, measured, [d for d in alive if d in facts])
            if result is not None and result.plan is not None:
                self._with_facts(result.plan, inputs.cluster, facts)
                self.log("re-costed " + result.plan.describe())
            return result
        return run

    async def _run_job(self, cluster, names: dict, plan: Plan, trainer, train_set, total: int, report,
                       replica: Replica | None = None) -> None:
        o = self.options
        async with trio.open_nursery() as nursery:
            # --devices N or a given plan: at most that many devices, however many more answer
            limit = o.devices or (len(plan.used_devices()) if o.plan_path else None)
            job_id = replica.job_id if replica else f"train-{uuid.uuid4().hex[:8]}"
            control = RosterControl(cluster, job_id, names, nursery, self.log, limit)
            job = JobSpec(plan, trainer.cfg, trainer.cfg_text, o.timeout_s, backup_interval=o.backup_interval)
            save_hook = self._save_hook(trainer)
            coordinator = TrainingCoordinator(control, job, trainer, train_set, strategy=self.strategy_for_replan(),
                                              checkpoint_every=o.checkpoint_every if save_hook else 0,
                                              save_hook=save_hook, log=self.log, recovery=o.recovery)
            coordinator.should_stop = lambda: self.stopping
            if o.recost and self.recost_inputs is not None and o.schedule == "1f1b":
                coordinator.recost = self._recoster()
            self.coordinator = coordinator
            lost = None
            if replica is not None:
                control.ever_in_plan |= set(replica.devices)
                coordinator.take_over(first_epoch(replica.next_term), replica.step, still_held(replica, names))
                lost = {n for n, node in replica_nodes(replica).items() if node == replica.coordinator} - set(names)
            coordinator.checkpoint_path = o.save_path if save_hook else None
            if o.run_id:
                coordinator.replicate = lambda: self._replicate(cluster, control, coordinator, nursery,
                                                                replica.elected_by if replica else [])
                coordinator.own_device = next((n for n, d in names.items() if d.node_id == own_agent(cluster)), None)

            def on_step(r: StepReport) -> None:
                if self.stopping:  # the stopping step committed: its weights come back before the run ends
                    self.stop_deadline = trio.current_time() + STOP_GRACE_S
                used = coordinator.plan.used_devices()
                util = "/".join(f"{100 * r.busy_s.get(n, 0.0) / max(r.seconds, 1e-9):.0f}" for n in used)
                replay = "  (replayed)" if r.replayed else ""
                report(r.step, r.loss, coordinator.plan.batch_size, r.seconds, f"  util {util}%{replay}",
                       {"utilisation": {n: r.busy_s.get(n, 0.0) / max(r.seconds, 1e-9) for n in used},
                        "device_times": {n: {"busy_s": r.busy_s.get(n, 0.0), **r.times.get(n, {})} for n in used},
                        "epoch": r.epoch, "replayed": r.replayed, "backup": r.backup, "devices": len(used),
                        "roles": device_roles(coordinator.plan)})

            try:
                await coordinator.run(total, on_step, lost)
                if coordinator.replicate is not None:  # done or stopped: the holders elect no successor
                    with trio.move_on_after(REPLICA_WAIT_S):
                        await self._replicate(cluster, control, coordinator, nursery,
                                              replica.elected_by if replica else [], finished=True)
            finally:
                with trio.CancelScope(shield=True):
                    await control.release()
            nursery.cancel_scope.cancel()

    async def _replicate(self, cluster, control: RosterControl, coordinator: TrainingCoordinator, nursery,
                         elected_by: list[str], finished: bool = False) -> None:
        """Send what a successor needs (failover.Replica) to the holders of this term: every
        device of the run when the term began but this device's own (it goes with this
        coordinator), in the plan or not. The first time, also take the term's lease on them
        (quorum.Lease). `finished`: the run ended, and the holders elect no successor."""
        o = self.options
        own = own_agent(cluster)
        devices = {n: {"node_id": d.node_id, "address": f"{d.address}:{d.port}", "incarnation": d.incarnation}
                   for n, d in control.names.items()}
        term = term_of(coordinator.epoch)
        if coordinator.lease is None:
            coordinator.lease = self._take_lease(cluster, control, coordinator, nursery, term, elected_by)
        lease = coordinator.lease
        holders = [devices[n]["node_id"] for n in lease.devices if n != lease.own and n in devices]
        backups = coordinator.backups
        held = {d: sorted(layers) for d, layers in backups.holdings.items()} if backups.step is not None else {}
        replica = Replica(o.run_id, control.job_id, term, coordinator.epoch, backups.step or 0,
                          held, coordinator.plan.to_dict(), devices, list(o.run_flags or []), own, holders,
                          term, list(elected_by), finished)
        for node_id in holders:
            try:
                await cluster.send(node_id, JobReplica(control.job_id, replica.term, replica.step, replica.to_body()))
            except (SwarmError, ConnectionLost):
                pass  # a device that cannot be reached now is being lost: the next replica goes to the survivors

    def _take_lease(self, cluster, control: RosterControl, coordinator: TrainingCoordinator, nursery, term: int,
                    elected_by: list[str]) -> Lease:
        """The term's lease over every device of the run as the term begins (those its first
        plan leaves out too: each holds a replica and votes, so a small plan does not leave a
        run with one or two holders) and this coordinator's own, and the task that asks them
        every LEASE_ASK_S whether they still follow it."""
        own = coordinator.own_device or COORDINATOR
        lease = Lease(set(control.names) | set(coordinator.plan.used_devices()) | {own}, own, term, LEASE_S,
                      trio.current_time())
        sent: dict[int, tuple[str, float]] = {}  # an ask's seq -> (device, when it was sent)
        seqs = itertools.count(1)

        def answered(node_id: str, msg: LeaseAnswer) -> None:
            asked = sent.pop(msg.seq, None)
            if asked is None or msg.job_id != control.job_id or asked[0] not in control.names \
                    or control.node_of(asked[0]) != node_id:
                return
            if msg.granted:
                lease.heard_from(asked[0], asked[1])
            else:
                lease.refused(msg.term, msg.why)

        async def ask(name: str, seq: int) -> None:
            with trio.move_on_after(LEASE_ASK_S):
                try:
                    await cluster.send(control.node_of(name), LeaseAsk(seq, control.job_id, term, list(elected_by)))
                except (SwarmError, ConnectionLost, KeyError):
                    pass  # it does not answer: the lease counts it out

        async def keep() -> None:
            while True:
                now = trio.current_time()
                for seq in [q for q, (_, at) in sent.items() if now - at > LEASE_S]:
                    del sent[seq]
                for name in lease.devices:
                    if name != own:
                        seq = next(seqs)
                        sent[seq] = (name, now)
                        nursery.start_soon(ask, name, seq)
                await trio.sleep(LEASE_ASK_S)

        cluster.on_lease_answer = answered
        nursery.start_soon(keep)
        return lease

    def _save_hook(self, trainer):
        """Writes the checkpoint once the coordinator holds the collected weights (or None)."""
        o = self.options
        if not (o.save_path and o.checkpoint_every):
            return None
        return lambda: save_checkpoint(o.save_path, trainer.state())

    def strategy_for_replan(self) -> str:
        s = self.options.strategy
        if s in ("dp", "pp", "tiles", "hybrid"):
            return s
        return "tiles" if self.plan and any(st.mode == "tiles" for st in self.plan.stages) else "pp"

    async def _watch_signals(self) -> None:
        """SIGINT or SIGTERM: before training, stop at once; during it, let the step under way
        commit and its weights come back (a checkpoint at that step) if each takes no more
        than STOP_GRACE_S, else stop without them (the checkpoint then holds the last weights
        collected). A second signal stops at once."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                async for _ in signals:
                    if self.stopping or self.coordinator is None:
                        self._stop_now()
                        continue
                    self.stopping = True
                    self.stop_deadline = trio.current_time() + STOP_GRACE_S
                    self.log("stopping after this step (Ctrl-C again to stop at once)")
                    nursery.start_soon(self._stop_at_deadline)

    async def _stop_at_deadline(self) -> None:
        while trio.current_time() < self.stop_deadline:  # moved on when the stopping step commits
            await trio.sleep_until(self.stop_deadline)
        self.log(f"the run did not stop within {STOP_GRACE_S:g} s; stopping without the step under way")
        self._stop_now()

    def _stop_now(self) -> None:
        self.interrupted = True
        self.run_scope.cancel()


def read_replica(path: str) -> Replica:
    import json

    try:
        return Replica.from_body(json.loads(open(path).read()))
    except (OSError, ValueError) as exc:
        raise SwarmError(f"cannot read the replica {path}: {exc}") from None


def own_agent(cluster) -> str:
    """The node id of this device's agent (a coordinator's id is the agent's and its pid:
    swarm.host.state.process_id)."""
    return cluster.credentials.node_id.split("~")[0]


def device_roles(plan: Plan) -> dict[str, str]:
    """What each device of `plan` holds, in a few words ("0-7 single; backs up 8-16"): two
    steps whose devices have the same roles hold the same weights, states and backups."""
    roles: dict[str, list[str]] = {}
    for p, s in enumerate(plan.stages):
        for d in dict.fromkeys(s.devices):
            if s.allocation:  # a dp share: its samples of each micro-batch
                share = f" {s.allocation.get(d, 0)} of {sum(s.allocation.values())} samples"
            else:
                share = f" of {len(s.devices)}" if len(s.devices) > 1 else ""
            roles.setdefault(d, []).append(f"{s.first}-{s.last - 1} {s.mode}{share}")
        holder = (plan.backups or {}).get(p)
        if holder is not None:
            roles.setdefault(holder, []).append(f"backs up {s.first}-{s.last - 1}")
    return {d: "; ".join(r) for d, r in roles.items()}


def still_held(replica: Replica, names: dict) -> dict[str, set[int]]:
    """The replica's holdings on devices that still hold them: an agent started again since
    (another incarnation than the replica names) lost what it held with its memory, and a
    move from it would never come."""
    def same_start(name: str) -> bool:
        member = names.get(name)
        return member is not None and member.incarnation == replica.devices.get(name, {}).get("incarnation")
    return {d: set(layers) for d, layers in replica.holdings.items() if same_start(d)}


def replica_nodes(replica: Replica) -> dict[str, str]:
    """Device name -> node id of every device of the replica's run."""
    return {n: d["node_id"] for n, d in replica.devices.items()}


def busy_hint(reasons) -> str:
    """What to do when agents refused because another run holds them."""
    if any("busy with job" in r for r in reasons):
        return " (another run is using these devices: `swarm status` shows it; wait for it to end or stop it)"
    return ""


class RosterControl:
    """The coordinator's hold on the swarm's devices for one training job: each epoch is a
    job handle at that epoch (agents refuse older epochs), assigned and started on the
    plan's devices; deaths and job failures come out of next_loss(), devices that join or
    come back out of next_join()."""

    def __init__(self, cluster, job_id: str, names: dict, nursery: trio.Nursery, log, limit: int | None = None):
        self.cluster = cluster
        self.limit = limit  # most devices a plan of this run may use (None: every device that answers)
        self.ever_in_plan: set[str] = set()
        self.job_id = job_id
        self.names = dict(names)  # device name -> swarm.cluster Device
        self.nursery = nursery
        self.log = log
        self.handle = None
        self.epoch_scope: trio.CancelScope | None = None
        self._loss_send, self._loss_recv = trio.open_memory_channel(math.inf)
        self._join_send, self._join_recv = trio.open_memory_channel(math.inf)
        self.in_plan: set[str] = set()
        self.epoch = 0  # the epoch under way
        self.failure_grace_s = 10.0  # how long a failed part waits for a death that explains it
        nursery.start_soon(self._watch_membership, cluster.subscribe())

    def node_of(self, name: str) -> str:
        return self.names[name].node_id

    async def spare(self, names: list[str]) -> dict[str, int]:
        """What these devices can spare now, as they say when asked again (those that say)."""
        nodes = {n: self.node_of(n) for n in names if n in self.names}
        await self.cluster.refresh(list(nodes.values()))
        spare = {n: getattr(self.cluster.device(node), "spare", None) for n, node in nodes.items()}
        return {n: int(s) for n, s in spare.items() if s is not None}

    def alive(self) -> list[str]:
        out = []
        for name, d in self.names.items():
            now = self.cluster.device(d.node_id)
            connected = getattr(now, "conn", None) is not None and not now.conn.closed
            if now is not None and connected and now.health not in ("dead", "left", "unreachable", "refused"):
                out.append(name)  # a suspect device is busy, not gone, until its probe fails
        return sorted(out)

    async def next_loss(self) -> set[str]:
        """Lost devices: a loss that only concerned an older epoch (a broken link) is news no
        longer, unless the device does not answer now (it died: a loss reported while the
        coordinator was between epochs must not be dropped with that epoch)."""
        while True:
            epoch, names = await self._loss_recv.receive()
            if epoch is None or epoch >= self.epoch:
                return names
            gone = set(names) - set(self.alive())
            if gone:
                return gone

    def gone(self) -> set[str]:
        """The devices the swarm knows dead or departed (whether or not their loss was reported)."""
        return {name for name, d in self.names.items()
                if getattr(self.cluster.device(d.node_id), "health", None) in ("dead", "left")}

    async def next_join(self) -> set[str]:
        return await self._join_recv.receive()

    async def _watch_membership(self, events) -> None:
        by_node = {d.node_id: n for n, d in self.names.items()}
        async for event in events:
            name = by_node.get(event.node_id)
            if event.kind in ("dead", "left") and name in self.in_plan:
                self.log(f"{name} is {event.kind} ({event.reason or 'no answer'})")
                self._lose({name})
            elif event.kind in ("joined", "recovered"):
                device = self.cluster.device(event.node_id)
                if device is None:
                    continue
                if name is None:  # a device new to this run
                    name = device.name if device.name not in self.names else f"{device.name}-{device.node_id[:6]}"
                    self.names[name] = device
                    by_node[device.node_id] = name
                if name not in self.in_plan and self.may_take(name):
                    self._join_send.send_nowait({name})

    def may_take(self, name: str) -> bool:
        """Whether a device that (re)appears may join: one that was in this run's plan may
        come back; a newcomer only while the run is below its --devices limit."""
        return name in self.ever_in_plan or self.limit is None or len(self.in_plan) < self.limit

    def admit(self, joined: list[str], in_use: int) -> list[str]:
        """Which of the devices that joined a re-plan takes in, within the --devices limit
        (those that were in the plan before come first)."""
        if self.limit is None:
            return joined
        returning = [d for d in joined if d in self.ever_in_plan]
        return (returning + [d for d in joined if d not in returning])[:max(0, self.limit - in_use)]

    async def start_epoch(self, epoch: int, job: JobSpec):
        self.epoch = epoch
        used = job.plan.used_devices()
        self.in_plan = set(used)
        self.ever_in_plan |= self.in_plan
        if self.epoch_scope is not None:
            self.epoch_scope.cancel()
        handle = self.cluster.job(self.job_id, epoch=epoch)
        self.handle = handle
        devices = {n: {"node_id": self.node_of(n), "address": f"{self.names[n].address}:{self.names[n].port}"}
                   for n in used}
        node_of = {n: d["node_id"] for n, d in devices.items()}
        node_of[COORDINATOR] = self.cluster.credentials.node_id
        spec = job_spec_dict(job, devices)

        name_of = {node: name for name, node in node_of.items()}
        unreachable: set[str] = set()

        async def send_to(node_id: str, body: dict) -> None:
            """A device that cannot be reached is a loss: the recovery it starts cancels the
            step that wanted to talk to it, so the message is dropped rather than raised."""
            try:
                await handle.send(node_id, handle.data(CHANNEL, body))
            except (SwarmError, ConnectionLost) as exc:
                name = name_of.get(node_id, node_id)
                if name not in unreachable:
                    unreachable.add(name)
                    self.log(f"{name} cannot be reached ({exc})")
                    self._lose({name}, epoch)

        def link_broke(key: tuple, payload: dict) -> None:
            """A device lost its link to another ("link", device, far end): the far end is lost."""
            reporter, far = key[1], key[2]
            if far not in unreachable:
                unreachable.add(far)
                self.log(f"{reporter} lost its link to {far} ({payload.get('reason', '?')})")
                self._lose({far}, epoch)

        endpoint = WireEndpoint(COORDINATOR, node_of, send_to, routes={LINK: link_broke})
        # the connections the parts are started on: one replaced or closed from here on may have lost messages
        conns = {n: getattr(self.cluster.device(node_of[n]), "conn", None) for n in used}
        # every device at once; one that refuses or cannot be reached counts as lost
        failed = await handle.assign_and_start("train", {node_of[n]: spec for n in used})
        why = {n: str(failed[node_of[n]]) or "no answer in time" for n in used if node_of[n] in failed}
        lost = set(why)
        for n in sorted(lost):
            self.log(f"{n} could not take its part: {why[n]}")
            del conns[n]
        fenced = [why[n] for n in sorted(lost) if "fenced" in why[n]]
        if fenced:
            raise SwarmError(f"another coordinator has taken this run over ({fenced[0]}); this one gives up")
        if lost and lost == set(used):  # nothing to re-plan onto: say why rather than "lost every device"
            raise SwarmError("no device could take its part of the run: "
                             + "; ".join(f"{n}: {why[n]}" for n in sorted(lost))
                             + busy_hint(why.values()))
        if lost:
            self._lose(lost, epoch)
        scope = trio.CancelScope()
        self.epoch_scope = scope
        self.nursery.start_soon(self._epoch_tasks, scope, endpoint, handle,
                                [(n, node_of[n]) for n in used if n not in lost], conns, epoch)
        return endpoint

    async def _epoch_tasks(self, scope, endpoint, handle, parts, conns: dict, epoch: int) -> None:
        """This epoch's message pump and watch on every part, until the next epoch."""
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(endpoint.pump, lambda: handle.receive(CHANNEL))
                nursery.start_soon(self._watch_links, {n: c for n, c in conns.items() if c is not None}, epoch)
                for name, node_id in parts:
                    nursery.start_soon(self._watch_job, handle, name, node_id, epoch)

    async def _watch_links(self, conns: dict, epoch: int) -> None:
        """A device whose connection with us closed or was replaced by a new one during the
        epoch may have lost messages either way: it counts as lost (and, if it answers, is
        taken in again at a later backup step)."""
        while conns:
            for name, conn in list(conns.items()):
                device = self.cluster.device(self.node_of(name))
                if getattr(device, "conn", None) is not conn or conn.closed:
                    del conns[name]
                    self.log(f"the connection to {name} broke")
                    self._lose({name}, epoch)
            await trio.sleep(LINK_WATCH_S)

    def _lose(self, names: set[str], epoch: int | None = None) -> None:
        """Report lost devices; `epoch`: a loss that only concerns that epoch's run (a broken
        link), news to no later one."""
        self._loss_send.send_nowait((epoch, set(names)))

    async def _watch_job(self, handle, name: str, node_id: str, epoch: int) -> None:
        """A part whose device is gone is a loss. A part that fails while its device is fine
        has usually lost a peer that is dying too: if no device is declared lost within the
        grace period (which cancels this watch with a new epoch), the run stops with its error."""
        try:
            await handle.wait_done(node_id)
        except JobError as exc:
            device = self.cluster.device(node_id)
            if device is None or device.health in ("dead", "left"):
                self._lose({name}, epoch)
                return
            missed = MISSING_HOLDING.search(str(exc))
            if missed is not None and missed.group(1) in self.names:
                # a device counted as holding layers it lacks (started again since): that holding
                # is lost, and so the device, for this epoch (taken in again at a backup step)
                self.log(f"{name} could not start: {missed.group(0)}; counting it lost")
                self._lose({missed.group(1)}, epoch)
                return
            await trio.sleep(self.failure_grace_s)
            raise SwarmError(f"{name} failed: {exc}") from None

    async def release(self) -> None:
        """Let go of every device of the job, all at once and within RELEASE_S (a device that
        does not answer in time lets go by itself once this coordinator is gone)."""
        if self.epoch_scope is not None:
            self.epoch_scope.cancel()
        if self.handle is None:
            return

        async def release(node_id: str) -> None:
            try:
                await self.handle.release(node_id, timeout=RELEASE_S)
            except (SwarmError, trio.TooSlowError):
                pass  # a device that is gone has nothing to release

        with trio.move_on_after(RELEASE_S):
            async with trio.open_nursery() as nursery:
                for node_id in sorted(self.handle.nodes):
                    nursery.start_soon(release, node_id)


def _accelerator_fact(plan: Plan, name: str, device) -> dict:
    """A plan file's "accelerator" for `name` (as `swarm plan --out` writes it for a device
    planned on its GPU), kept if the device's agent offers it: the worker computes there."""
    wanted = (plan.devices.get(name) or {}).get("accelerator")
    if not wanted or wanted == HOST.type:
        return {}
    offered = getattr(device, "accelerator", None) or HOST.type
    if offered not in (wanted, "?"):  # "?": an agent that does not say; its worker will tell
        raise SwarmError(f"the plan puts {name}'s layers on {wanted}, but its agent offers {offered} "
                         f"(`swarm join --accelerator {wanted}` there, or plan it without)")
    return {"accelerator": wanted}


__all__ = ["SwarmOptions", "SwarmRunner", "PlanError"]
