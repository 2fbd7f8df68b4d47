"""`swarm plan`: what would run where, and how fast — for a described cluster or this machine."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from swarm.commands.flags import (IMG_SIZE_HELP, add_network_args, image_size, model_name, non_negative_float,
                                  positive_int)
from swarm.errors import SwarmError

STRATEGY_HELP = ("local, dp, pp, tiles, jointdnn, hiertrain, asteroid, or auto (default: the best predicted of all, "
                 "including tiles + pipeline hybrids)")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan how to split training over devices, predict its speed and memory",
                       description="Plan which layers run where and how they are split, and predict the step time "
                                   "and memory per device. With --devices, plan a cluster described in a JSON file "
                                   "(docs/planner.md); without it, the devices of the swarm (`swarm join`) are "
                                   "profiled and planned, or this machine alone when none answers.")
    p.add_argument("--model", type=model_name, default="yolov2-16",
                   help="a built-in model or a .cfg path (default: yolov2-16)")
    p.add_argument("--img-size", type=image_size, metavar="N|WxH", help=f"input size: {IMG_SIZE_HELP} (default: as "
                   "swarm train: 128 for the built-in YOLO models (256 yolov4-tiny), a .cfg file's own)")
    p.add_argument("--classes", type=positive_int, help="classes of a built-in detector's head (default: the built-in "
                   "data's)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="samples per optimizer step (default: 16)")
    p.add_argument("--microbatches", type=positive_int, default=1,
                   help="micro-batches per step, as for swarm train (default: 1; pipelines need several)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="decides the optimizer state in memory")
    p.add_argument("--devices", metavar="CLUSTER.json", help="a cluster description (see examples/*cluster*.json)")
    p.add_argument("--strategy", default="auto", metavar="NAME", help=STRATEGY_HELP)
    p.add_argument("--jointdnn", metavar="FORM[:BUDGET]", type=jointdnn_form,
                   help="jointdnn's objective: latency (default), energy, battery:JOULES (least latency within a "
                        "mobile energy budget), cloud:SECONDS (within a cloud compute budget), qos:SECONDS (least "
                        "energy within a deadline)")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan (JSON) here")
    p.add_argument("--show", metavar="PLAN.png", help="draw one step's timeline per device (and tile grids) here")
    p.add_argument("--compare", action="store_true", help="run every planner and compare them side by side")
    p.add_argument("--accelerators", choices=("on", "off"), default="on",
                   help="off: plan every device on its CPU, ignoring the accelerators (GPUs) the cluster gives "
                        "(default: on, a device with an accelerator computes on it)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument("--local", action="store_true", help="plan for this machine alone, without looking for the swarm")
    p.add_argument("--wait", type=non_negative_float, default=2.0, metavar="SECONDS",
                   help="how long to look for devices of the swarm (default: 2)")
    add_network_args(p)
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding the cluster token (default: $SWARM_TOKEN, else STATE_DIR/token)")
    p.add_argument("--state-dir", metavar="DIR", help="where profiles are cached (default: $SWARM_STATE_DIR, "
                   "/var/lib/swarm as root, else ~/.local/share/swarm)")
    p.add_argument("--threads", type=positive_int, help="threads when profiling this machine (default: all usable cores, "
                   "fewer where OMP_NUM_THREADS says)")
    p.set_defaults(run=run)


def jointdnn_form(text: str) -> tuple[str, float | None]:
    form, _, budget = text.partition(":")
    if form in ("latency", "energy") and not budget:
        return form, None
    if form in ("battery", "cloud", "qos") and budget:
        try:
            value = float(budget)
        except ValueError:
            value = -1.0
        if value > 0:
            return form, value
        raise argparse.ArgumentTypeError(f"the budget of {form} must be a positive number, got '{budget}'")
    raise argparse.ArgumentTypeError(f"'{text}' is not latency, energy, battery:J, cloud:S or qos:S")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class LocalProfiles:
    """Profiles this machine on first need (cached in the state directory) and reads profile files."""

    def __init__(self, args: argparse.Namespace, desc, classes: int | None):
        self.args, self.desc, self.classes = args, desc, classes
        self.profile = None  # this machine's, once used

    def local(self):
        from swarm.host.state import state_dir_from
        from swarm.profiling.profiler import load_or_profile

        if self.profile is None:
            profile, cached, path = load_or_profile(self.args.model, self.desc.img_size, self.classes,
                                                    state_dir_from(self.args.state_dir), threads=self.args.threads,
                                                    log=lambda t: say(f"profiling this machine: {t}"))
            say(f"{'using the cached profile' if cached else 'profiled this machine; cached in'} {path}")
            self.profile = profile
        return self.profile

    def resolve(self, spec, base: Path):
        """A cluster file's profile reference -> CostTable."""
        from planner.profile import DeviceProfile, ProfileError
        from swarm.profiling.profiler import read_profile

        if spec == "local":
            profile = self.local()
        elif isinstance(spec, dict) and spec.get("kind") == "swarm-profile":
            try:
                profile = DeviceProfile.from_dict(spec)
            except ProfileError as exc:
                raise SwarmError(f"inline profile: {exc}") from None
        elif isinstance(spec, (str, dict)):
            path = spec["profile"] if isinstance(spec, dict) else spec
            path = Path(path) if Path(path).is_absolute() else base / path
            profile = read_profile(path)
        else:
            raise SwarmError(f"a profile is \"local\", a file name or a profile object, not {spec!r}")
        try:
            profile.check_matches(self.desc)
        except ProfileError as exc:
            raise SwarmError(str(exc)) from None
        return profile.costs


def describe(args: argparse.Namespace):
    from swarm.data import default_classes
    from swarm.zoo import default_img_size, describe_model

    args.img_size = default_img_size(args.model, args.img_size)  # what swarm train trains at
    classes = args.classes if args.classes is not None else default_classes(args.model, args.img_size)
    return describe_model(args.model, args.img_size, classes), classes


def cluster_from_file(path: str, desc, profiles: LocalProfiles):
    from planner.cluster import ClusterError, cluster_from_dict

    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SwarmError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SwarmError(f"{path} is not valid JSON: {exc}") from None
    try:
        return cluster_from_dict(data, desc, lambda spec: profiles.resolve(spec, Path(path).parent))
    except ClusterError as exc:
        raise SwarmError(f"{path}: {exc}") from None


def this_machine(desc, profiles: LocalProfiles, why: str):
    """A cluster of this machine alone: its profile, and what it can spare now (with the default
    reserve, swarm/host/resources.py) less what the runtime uses."""
    import platform

    import numpy as np

    from planner.cluster import Cluster, Device
    from planner.memory import JOB_BYTES
    from swarm.host.resources import spare_memory

    profile = profiles.local()
    name = platform.node() or "this-machine"
    spare = spare_memory()
    budget = max(0.0, spare - profile.runtime_bytes - JOB_BYTES)
    say(f"{why}; planning for this machine alone (to plan other devices: `swarm join` on them, or describe them "
        "with --devices CLUSTER.json, see docs/planner.md)")
    facts = {"cores": profile.device.get("cores"), "spare": spare}
    if profile.device.get("allocator"):
        facts["allocator"] = profile.device["allocator"]
    return Cluster([Device(name, profile.costs, budget, facts=facts)],
                   np.full((1, 1), np.inf), 0.0, None, "this machine")


def live_cluster(args: argparse.Namespace, desc, classes: int | None):
    """The swarm's devices, profiled on each (a job on every agent, cached there) and the
    bandwidth between every pair measured: (Cluster, one of the profiles, None), or
    (None, None, why not)."""
    import os

    from swarm.ports import DEFAULT_PORT
    from swarm.errors import run_trio
    from swarm.host.state import NoToken, find_token, process_id, state_dir_from
    from swarm.net import Credentials, parse_peers, resolve_network
    from swarm.profiling.survey import cluster_from_live, estimated_cluster, gather_live

    state_dir = state_dir_from(args.state_dir)
    try:
        token, _ = find_token(args.token_file, state_dir, create=False)
    except NoToken:
        return None, None, "no cluster token here (so no swarm to ask)"
    network = resolve_network(args.interface)
    peers = parse_peers(args.peers or os.environ.get("SWARM_PEERS"), DEFAULT_PORT)
    credentials = Credentials(process_id(state_dir), token)
    from swarm.zoo import BUILTIN, model_source

    spec = {"model": args.model, "img_size": desc.img_size.to_json(), "classes": classes,
            "cfg": None if args.model in BUILTIN else model_source(args.model)[1], "threads": args.threads}
    # --accelerators off: every device profiled, and so planned, on its CPU
    live = run_trio(gather_live, credentials, network, peers, spec, args.wait, say, True, args.accelerators == "on")
    if live is None:
        return None, None, f"no device of the swarm answered within {args.wait:g} s"
    if live["profiles"] is None:
        say(f"could not profile the devices ({live['why']}); planning on estimates: compute by cores, nominal links")
        return estimated_cluster({d["name"]: d for d in live["devices"]}, desc), None, None
    return cluster_from_live(live, desc), next(iter(live["profiles"].values())), None


def run(args: argparse.Namespace) -> int:
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel, plan_allocator
    from planner.planners import STRATEGIES, compare, make_plan
    from planner.report import compare_table, plan_table
    from swarm.local.batchnorm_check import microbatch_refusal

    if args.strategy not in STRATEGIES:
        raise SwarmError(f"unknown --strategy '{args.strategy}'; choose one of {', '.join(STRATEGIES)}")
    if args.compare and args.strategy != "auto":
        raise SwarmError("--compare runs every strategy; leave out --strategy")
    if args.jointdnn and args.strategy != "jointdnn":
        raise SwarmError("--jointdnn applies to --strategy jointdnn")
    desc, classes = describe(args)
    refused = microbatch_refusal(desc, args.batch_size, args.microbatches)
    if refused is not None:  # planned all the same: the planners' figures hold, the training would not run
        say(f"note: swarm train would refuse this batch: {refused}")
    profiles = LocalProfiles(args, desc, classes)
    measured = None  # a profile of any device: the saved bytes per layer
    if args.devices:
        cluster = cluster_from_file(args.devices, desc, profiles)
    elif args.local:
        cluster = this_machine(desc, profiles, "--local")
    else:
        cluster, measured, why = live_cluster(args, desc, classes)
        if cluster is None:
            cluster = this_machine(desc, profiles, why)
    if args.accelerators == "off":
        cluster = cluster.on_cpus()
    measured = profiles.profile or measured
    mem = MemoryModel.for_devices(desc, args.optimizer, measured.act_bytes if measured is not None else None,
                                  plan_allocator(d.facts.get("allocator") for d in cluster.devices))
    inputs = PlanInputs(desc, mem, cluster, args.batch_size, args.microbatches)
    if args.compare:
        rows = compare(inputs)
        print(compare_table(rows))
        chosen = [r.plan for r in rows if r.strategy == "auto" and r.plan is not None]
        if not chosen:
            return 2
        plan = chosen[0]
    elif args.strategy == "jointdnn" and args.jointdnn:
        from planner.jointdnn import plan_jointdnn

        plan = plan_jointdnn(inputs, objective=args.jointdnn[0], budget=args.jointdnn[1])
    else:
        plan = make_plan(args.strategy, inputs)
    timeline = inputs.simulate(plan)
    if args.json:
        print(plan.to_json())
    elif not args.compare:
        print(plan_table(plan, timeline))
        if args.microbatches == 1 and len(cluster.devices) > 1:
            say("hint: with one micro-batch a pipeline cannot overlap its stages; try --microbatches 4")
    if args.show:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SwarmError("--show draws with matplotlib, which is not installed: pip install 'swarm-train[plot]' "
                             "(or pip install matplotlib)") from None
        from planner.picture import draw_plan

        draw_plan(plan, timeline, desc, args.show)
        say(f"picture: {args.show}")
    if not timeline.fits:
        from planner.plan import PlanError

        raise PlanError("the plan does not fit: " + "; ".join(o.message() for o in timeline.overflows(plan))
                        + ("" if args.out is None else f" (not written to {args.out})"))
    if args.out:
        try:
            Path(args.out).write_text(plan.to_json() + "\n")
        except OSError as exc:
            raise SwarmError(f"cannot write {args.out}: {exc.strerror or exc}") from None
        say(f"plan: {args.out}")
    return 0
