"""The `swarm` command: subcommands, and turning user mistakes into plain messages."""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading

from swarm import __version__
from swarm.errors import SwarmError
from swarm.host import malloc

# Each subcommand module has add_parser(subparsers) and run(args) -> exit status.
COMMANDS = ("train", "eval", "export", "join", "status", "token", "testbed", "plan", "profile", "service", "plot", "detect", "data",
            "jobs")


class Parser(argparse.ArgumentParser):
    """A mistake in the flags is one line naming the flag and what it accepts (and where the
    help is), not the usage text first: the subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = Parser(prog="swarm", description="Train convolutional networks across the small devices on your LAN.")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"swarm.commands.{name}_cmd")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    malloc.tune()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started in the background by a script, which leaves SIGINT ignored: Ctrl-C and
        # `swarm stop` (which stops a detached run the same way) must still reach it
        signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = build_parser()
    args = parser.parse_args(argv)
    from planner.plan import PlanError

    try:
        return int(args.run(args) or 0)
    except (SwarmError, PlanError) as exc:
        print(f"swarm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    """The `swarm` command itself: on jemalloc where it is installed (swarm.host.malloc), then main."""
    malloc.preload()
    leave(main())


def leave(code: int) -> None:
    """Exit with `code` without the interpreter's module-by-module teardown, which with torch
    loaded takes about half a second of every command (bench/RESULTS.md, "The suite's time").
    What a normal exit does that matters is done first: the atexit functions (logging's
    flush, multiprocessing's joins) and the standard streams' flush; every file swarm writes
    is closed where it is written. A command that left a thread running exits the normal
    way, which waits for it."""
    if "torch" not in sys.modules or any(t is not threading.main_thread() and not t.daemon
                                         for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, a closed stream
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
