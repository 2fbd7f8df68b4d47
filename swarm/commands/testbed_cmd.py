"""`swarm testbed`: a cluster of agents on this one machine, for tests and experiments."""
from __future__ import annotations

import argparse

from swarm.commands.flags import positive_float, positive_int
from swarm.errors import SwarmError
from swarm.host.resources import parse_size
from swarm.testbed import netns


def memory_size(text: str) -> int:
    """'1G', '512M', '1GiB', '2048' (bytes) -> bytes."""
    value = parse_size(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (e.g. 1G, 512M)")
    if value < 32 * 2**20:
        raise argparse.ArgumentTypeError(f"{text} is too little memory for an agent (at least 32M)")
    return value


def bandwidth_rate(text: str) -> str:
    try:
        netns.rate_bytes(text)
    except SwarmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.lower()


def each(kind):
    """An argument type: one value of `kind`, or a comma list of them (one per device)."""
    def parse(text: str) -> list:
        return [kind(part) for part in text.split(",")]
    parse.__name__ = kind.__name__
    return parse


def add_parser(sub) -> None:
    p = sub.add_parser("testbed", help="a cluster of agents on this machine (tests, experiments)", description=(
        "Run several agents on this machine as a cluster. As root: each device gets its own network "
        "namespace and address on a bridge, a CPU quota and memory limit, and a capped link. "
        "With --loopback (no root): agents on 127.0.0.1 ports that know each other by --peers."))
    commands = p.add_subparsers(dest="testbed_command", metavar="ACTION")
    commands.required = True

    up = commands.add_parser("up", help="start the devices")
    up.add_argument("--devices", type=positive_int, help="how many devices (dev0, dev1, ...)")
    up.add_argument("--cluster", metavar="CLUSTER.json", help="rehearse a described cluster (the file `swarm plan "
                    "--devices` reads): a device per entry, its CPU share from its \"speed\" relative to "
                    "\"reference\": \"local\", its memory limit from its \"memory\" and what the runtime takes, "
                    "its link from \"link_mbps\" or \"bandwidth_mbps\"")
    up.add_argument("--cpu", type=each(positive_float), help="CPU quota per device in cores, e.g. 0.25, or one each: "
                    "0.1,0.1,0.2,0.2,0.4,0.6 (cgroup)")
    up.add_argument("--mem", type=each(memory_size), help="memory limit per device, e.g. 1G, or one each: 1G,1G,2G "
                    "(cgroup)")
    up.add_argument("--bandwidth", type=each(bandwidth_rate), help="cap of each device's link, e.g. 100mbit, or one "
                    "each: 100mbit,20mbit (tc htb, acknowledgements first)")
    up.add_argument("--loopback", action="store_true", help="agents on 127.0.0.1 instead of namespaces (no root)")
    commands.add_parser("down", help="stop and remove everything the testbed made (safe to repeat)")
    for action, text in (("kill", "SIGKILL a device's agent"),
                         ("cut", "take a device's link down (loopback: freeze its agent)"),
                         ("heal", "bring a device's link back up (loopback: resume its agent)"),
                         ("restart", "start a killed device's agent again, as after a reboot")):
        commands.add_parser(action, help=text).add_argument("device", help="e.g. dev1")
    ex = commands.add_parser("exec", help="run a command as one of the devices (in its namespace)",
                             description="Run CMD inside the device's network namespace, with SWARM_TOKEN and "
                                         "SWARM_INTERFACE set for the testbed: e.g. "
                                         "`swarm testbed exec dev0 -- swarm status`.")
    ex.add_argument("--in-cgroup", action="store_true", help="run inside the device's cgroups too (its CPU share "
                    "and memory limit, beside its agent), as a process of that device would")
    ex.add_argument("device", help="e.g. dev0")
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    st = commands.add_parser("status", help="the devices, their agents and links")
    st.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    from swarm.testbed import testbed

    action = args.testbed_command
    if action == "up":
        count, cpu, memory, bandwidth, names = args.devices, args.cpu, args.mem, args.bandwidth, None
        if args.cluster:
            if args.cpu or args.mem or args.bandwidth:
                raise SwarmError("--cluster gives every device's limits; leave out --cpu, --mem and --bandwidth")
            names, cpu, memory, bandwidth = testbed.limits_from_cluster(read_json(args.cluster), args.cluster)
            if count not in (None, len(names)):
                raise SwarmError(f"{args.cluster} describes {len(names)} devices, not --devices {count}")
            count = len(names)
        if count is None:
            raise SwarmError("say how many devices: --devices N (or --cluster CLUSTER.json)")
        record = testbed.up(count, cpu=cpu, memory=memory, bandwidth=bandwidth, loopback=args.loopback)
        print(f"testbed up: {len(record.devices)} devices ({record.kind})")
        for k, d in enumerate(record.devices):
            described = f"  as {names[k]}" if names else ""
            print(f"  {d.name}  {d.address}:{d.port}  pid {d.pid}  {limits(d.cpu, d.memory, d.bandwidth)}{described}")
        if record.kind == "netns":
            print(f"host address on the bridge: {testbed.HOST_ADDRESS} ({testbed.BRIDGE}); "
                  f"try: swarm testbed exec dev0 -- swarm status")
        return 0
    if action == "down":
        removed = testbed.down()
        print(f"testbed down: removed {len(removed)} things" if removed else "testbed down: nothing to remove")
        return 0
    if action in ("kill", "cut", "heal", "restart"):
        device = getattr(testbed, action)(args.device)
        print({"kill": f"killed the agent of {device.name} (pid {device.pid})",
               "cut": f"cut {device.name} off", "heal": f"healed {device.name}",
               "restart": f"restarted the agent of {device.name} (pid {device.pid})"}[action])
        return 0
    if action == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        testbed.exec_in(args.device, argv, in_cgroup=args.in_cgroup)  # does not return
    record = testbed.load()
    if record is None:
        if args.json:
            print("null")
        else:
            print("no testbed is up")
        return 0
    rows = testbed.status_rows(record)
    if args.json:
        import json

        print(json.dumps({"kind": record.kind, "cpu": record.cpu, "memory": record.memory,
                          "bandwidth": record.bandwidth, "devices": rows}, indent=2))
    else:
        print(f"{record.kind} testbed, {len(rows)} devices")
        for r in rows:
            print(f"  {r['device']:6} {r['address']:21} pid {r['pid']:<7} agent {r['agent']:8} link {r['link']:14} "
                  f"{limits(r['cpu'], r['memory'], r['bandwidth'])}")
    return 0


def read_json(path: str):
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise SwarmError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SwarmError(f"{path} is not JSON: {exc}") from None


def limits(cpu: float | None, memory: int | None, bandwidth: str | None) -> str:
    """"0.2 core, 1 GiB, 100mbit"; "no limits"."""
    return ", ".join(x for x in (f"{cpu:g} core" if cpu else "", f"{memory / 2**30:g} GiB" if memory else "",
                                 bandwidth or "") if x) or "no limits"

