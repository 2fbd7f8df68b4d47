"""`swarm token`: print the cluster token, to copy to the other devices; `--new` makes a fresh one."""
from __future__ import annotations

import sys

from swarm.commands.flags import add_token_args


def add_parser(sub) -> None:
    p = sub.add_parser("token", help="print the cluster token (or a new one)", description=(
        "Print the cluster token that devices use to recognise each other. On a device running "
        "`swarm join` it is the one in its state directory (created there if there is none yet). "
        "Give it to the other devices with SWARM_TOKEN=... or --token-file."))
    add_token_args(p)
    p.add_argument("--new", action="store_true", help=(
        "print a new random token (256 bits) and store it nowhere: to change a cluster's token, save it "
        "to a file and install it on every device (deploy/install.sh --token-file FILE)"))
    p.set_defaults(run=run)


def run(args) -> int:
    from swarm.host.state import find_token, new_token, state_dir_from

    if args.new:
        print(new_token())
        return 0
    token, where = find_token(args.token_file, state_dir_from(args.state_dir), create=True)
    if where.endswith("(new)"):
        print(f"swarm token: created a new cluster token in {where.removesuffix(' (new)')}", file=sys.stderr)
    print(token)
    return 0
