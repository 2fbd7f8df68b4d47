"""Plans set against one survey of a live swarm: what `auto` plans on it, and what the planner
predicts for plans written by hand, on the same profiles.

The host's speed drifts from one testbed run to the next, and each run profiles its devices
afresh; to compare plans on the same figures, survey once (run as a device of the swarm, e.g.
inside a testbed device's namespace) and plan from the file as often as needed:

    swarm testbed up --devices 6 --cpu 0.1,0.1,0.2,0.2,0.4,0.6 --mem 1G --bandwidth 100mbit
    swarm testbed exec dev0 -- .venv/bin/python bench/plan_offline.py survey SURVEY.json \\
        --model yolov2-16 --img-size 416
    .venv/bin/python bench/plan_offline.py plans SURVEY.json --model yolov2-16 --img-size 416 \\
        --batch-size 32 --microbatches 8 [PLAN.json ...]

`survey` gathers what `swarm plan` does without --devices (swarm.profiling.survey.gather_live:
each device's cached profile, what it can spare, every link) and writes it as JSON. `plans`
builds the planner's inputs from it as `swarm train --strategy auto` does
(swarm.execution.launch: the devices' measured costs, the memory model of their allocator with
the profile's saved bytes), prints `auto`'s plan, and for each PLAN.json (as `swarm plan --out`
writes, or planner.plan.Plan(...).to_json()) its predicted samples/s and step, whether it fits,
and each device's peak against its budget and its busy time. Before them, the compute floor:
each device's time for one micro-batch through the whole model (keeping its maps, and remaking
BatchNorm: planner.recompute), the step the devices' summed rates would take with the batch
divided perfectly and nothing exchanged, over every device and over those `auto` uses, and the
least step of any plan of whole-model replicas, where devices take whole micro-batches or split
them in groups (planner.bounds.replica_floor: what whole micro-batches leave of that rate).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def survey(args) -> None:
    from swarm.agent import DEFAULT_PORT
    from swarm.errors import run_trio
    from swarm.host.state import default_state_dir, find_token, process_id
    from swarm.net import Credentials, parse_peers, resolve_network
    from swarm.profiling.survey import gather_live
    from swarm.zoo import describe_model

    desc = describe_model(args.model, args.img_size)
    cfg = Path(args.model).read_text() if args.model.endswith(".cfg") else None
    spec = {"model": args.model, "img_size": desc.img_size.to_json(), "classes": None, "cfg": cfg,
            "threads": None, "refresh": False}
    state = default_state_dir()
    token, _ = find_token(None, state, create=False)
    peers = parse_peers(os.environ.get("SWARM_PEERS"), DEFAULT_PORT)
    live = run_trio(gather_live, Credentials(process_id(state), token), resolve_network(None), peers, spec,
                    args.wait)
    if live is None:
        raise SystemExit("no device of the swarm answered")
    out = dict(live, profiles={node: profile.to_dict() for node, profile in live["profiles"].items()},
               links=[[a, b, link] for (a, b), link in live["links"].items()])  # (keyed by pairs of nodes)
    Path(args.out).write_text(json.dumps(out))
    print(f"{len(live['devices'])} devices: {', '.join(d['name'] for d in live['devices'])}; written to {args.out}")


def load(path: str, model: str, img_size: int, batch: int, microbatches: int):
    """The planner's inputs on a survey file, as swarm.execution.launch builds them for auto."""
    from planner.inputs import PlanInputs
    from planner.memory import MemoryModel, plan_allocator
    from planner.profile import DeviceProfile
    from swarm.profiling.survey import cluster_from_live
    from swarm.zoo import describe_model

    live = json.loads(Path(path).read_text())
    live["profiles"] = {node: DeviceProfile.from_dict(d) for node, d in live["profiles"].items()}
    live["links"] = {(a, b): link for a, b, link in live["links"]}
    cfg = Path(model).read_text() if model.endswith(".cfg") else None
    profile = next(iter(live["profiles"].values()))
    desc = describe_model(model, img_size, profile.classes, cfg)
    cluster = cluster_from_live(live, desc)
    mem = MemoryModel.for_devices(desc, "sgd", profile.act_bytes,
                                  plan_allocator(d.facts.get("allocator") for d in cluster.devices))
    return desc, PlanInputs(desc, mem, cluster, batch, microbatches)


def plans(args) -> None:
    from planner.plan import Plan
    from planner.planners import make_plan

    desc, inputs = load(args.survey, args.model, args.img_size, args.batch_size, args.microbatches)
    auto = make_plan("auto", inputs)
    floor(inputs, auto.used_devices())
    print(auto.describe())
    show("auto", auto, inputs)
    for path in args.plan:
        plan = Plan.from_json(Path(path).read_text())
        print(plan.describe())
        show(path, plan, inputs)


def floor(inputs, used: list[str]) -> None:
    """What the devices' compute alone allows (module docstring)."""
    from planner.bounds import replica_floor
    from planner.recompute import recomputing

    _, remaking = recomputing(inputs.mem, inputs.cluster, inputs.desc)
    n, micro = inputs.num_layers, inputs.microbatch
    rates = {}
    print(f"one micro-batch of {micro} through the whole model:")
    for kept, remade in zip(inputs.cluster.devices, remaking.devices):
        t_kept = kept.costs.range_time(0, n, micro, with_loss=True)
        t_remade = remade.costs.range_time(0, n, micro, with_loss=True)
        rates[kept.name] = (micro / t_kept, micro / t_remade)
        print(f"  {kept.name}: {t_kept:.2f} s keeping its maps, {t_remade:.2f} s remaking BatchNorm")
    for what, names in (("every device", list(rates)), (f"the {len(used)} auto uses", used)):
        for i, form in enumerate(("keeping maps", "remaking")):
            rate = sum(rates[d][i] for d in names)
            print(f"  the floor over {what}, {form}: {rate:.3f} samples/s, {inputs.batch_size / rate:.2f} s a step")
    best = replica_floor(inputs)
    if best is not None:
        groups = "; ".join(f"{'+'.join(f'{d}:{s}' for d, s in zip(g, split))} {k}" for g, k, split in best.groups)
        print(f"  the floor of whole-model replicas, keeping maps: {inputs.batch_size / best.step:.3f} samples/s, "
              f"{best.step:.2f} s a step (groups, samples of a micro-batch each, micro-batches: {groups})")


def show(name: str, plan, inputs) -> None:
    t = inputs.simulate(plan)
    mib = 2**20
    print(f"  {name}: {t.throughput:.3f} samples/s, {t.step_time:.2f} s a step, {'fits' if t.fits else 'DOES NOT FIT'}")
    for d in sorted(t.peak_memory):
        print(f"    {d}: peak {t.peak_memory[d] / mib:.0f} of {t.budgets[d] / mib:.0f} MiB, busy {t.busy.get(d, 0.0):.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("survey", help="survey the live swarm and write it to a file")
    s.add_argument("out", metavar="SURVEY.json")
    s.add_argument("--model", default="yolov2-16")
    s.add_argument("--img-size", type=int, default=416)
    s.add_argument("--wait", type=float, default=5.0, help="seconds to wait for the devices to answer")
    s.set_defaults(run=survey)
    q = sub.add_parser("plans", help="auto's plan and the given plans, predicted on a survey file")
    q.add_argument("survey", metavar="SURVEY.json")
    q.add_argument("plan", nargs="*", metavar="PLAN.json")
    q.add_argument("--model", default="yolov2-16")
    q.add_argument("--img-size", type=int, default=416)
    q.add_argument("--batch-size", type=int, default=32)
    q.add_argument("--microbatches", type=int, default=8)
    q.set_defaults(run=plans)
    args = p.parse_args()
    try:
        args.run(args)
    except (OSError, ValueError, KeyError) as exc:  # a missing or malformed file, a plan for other devices
        raise SystemExit(f"plan_offline: {exc.__class__.__name__}: {exc}") from None


if __name__ == "__main__":
    main()
