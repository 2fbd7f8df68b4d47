"""How busy each testbed device's link is while a command runs (root).

    sudo .venv/bin/python bench/link_use.py [--interval 0.05] [--skip S | --last S] [--out SERIES.jsonl] -- CMD ARGS...

e.g. with a testbed up (`swarm testbed up --devices 8 --cpu 0.2 --mem 1G --bandwidth 100mbit`):

    sudo .venv/bin/python bench/link_use.py -- .venv/bin/python -m swarm testbed exec dev0 -- \\
        .venv/bin/python -m swarm train --strategy dp --devices 8 --batch-size 8 --steps 8 --no-eval

Reads the byte counters of every device's link (the host end of its veth: what the host end
receives the device sent) every --interval seconds while CMD runs. Per device and direction it
prints, after the first --skip seconds (a run's start-up, profiling and first step), or over
the --last seconds before the links went quiet at the end (a run's steady steps), the
megabytes moved and, over the span in which that device moved anything (its first such
interval to its last), the share of intervals in which the link ran at 80% of its rate or
more and the share in which it moved nothing. --out keeps the whole series (one line per
interval: seconds, then [sent, received] bytes per device) to plot or read.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.testbed import testbed  # noqa: E402

UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
BUSY = 0.8  # of the link's rate: a busy interval
MOVING = 0.02  # of the link's rate: anything at all (a heartbeat is less)


def rate_bytes(text: str) -> float:
    """Bytes a second of a tc rate such as 100mbit."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", text.lower()).groups()
    return float(number) * UNITS[unit] / 8


def counters(links: list[str]) -> list[tuple[int, int]]:
    """(sent by the device, received by it) for each host-side link."""
    out = []
    for link in links:
        stats = Path("/sys/class/net") / link / "statistics"
        out.append((int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())))
    return out


def summary(series: list[list], rates: list[float], interval: float) -> list[dict]:
    rows = []
    for k, rate in enumerate(rates):
        row = {}
        for j, way in enumerate(("out", "in")):
            moved = [s[1 + k][j] for s in series]
            active = [i for i, b in enumerate(moved) if b >= MOVING * rate * interval]
            span = moved[active[0]:active[-1] + 1] if active else []
            row[way] = {"mb": sum(moved) / 1e6, "span_s": len(span) * interval,
                        "busy": sum(b >= BUSY * rate * interval for b in span) / max(1, len(span)),
                        "idle": sum(b < MOVING * rate * interval for b in span) / max(1, len(span))}
        rows.append(row)
    return rows


def window(series: list[list], rates: list[float], args: argparse.Namespace) -> list[list]:
    """The intervals the shares are taken over: after --skip, or the --last seconds before
    the last interval in which any link moved something."""
    if args.last is None:
        return [s for s in series if s[0] > args.skip]
    moving = [s[0] for s in series if any(b >= MOVING * rate * args.interval
                                           for pair, rate in zip(s[1:], rates) for b in pair)]
    end = moving[-1] if moving else 0.0
    return [s for s in series if end - args.last < s[0] <= end]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=0.05)
    span = p.add_mutually_exclusive_group()
    span.add_argument("--skip", type=float, default=0.0, help="seconds at the start left out of the shares")
    span.add_argument("--last", type=float, help="only the seconds before the links' last traffic")
    p.add_argument("--out", help="keep the series here (JSON lines)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    record = testbed.load()
    if record is None or record.kind != "netns":
        p.error("no namespace testbed is up (swarm testbed up, as root)")
    devices = record.devices
    rates = [rate_bytes(d.bandwidth or "1gbit") for d in devices]
    links = [d.link for d in devices]
    series, t0 = [], time.monotonic()
    before = counters(links)
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        time.sleep(args.interval)
        now = counters(links)
        series.append([round(time.monotonic() - t0, 3)] + [[a[0] - b[0], a[1] - b[1]] for a, b in zip(now, before)])
        before = now
    if args.out:
        Path(args.out).write_text("".join(json.dumps(s) + "\n" for s in series))
    print(f"{'device':8} {'out MB':>7} {'busy':>5} {'idle':>5} {'in MB':>7} {'busy':>5} {'idle':>5}  span s")
    for d, row in zip(devices, summary(window(series, rates, args), rates, args.interval)):
        o, i = row["out"], row["in"]
        print(f"{d.name:8} {o['mb']:7.1f} {o['busy']:5.0%} {o['idle']:5.0%} {i['mb']:7.1f} {i['busy']:5.0%} "
              f"{i['idle']:5.0%}  {max(o['span_s'], i['span_s']):.1f}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
