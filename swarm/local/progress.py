"""A training progress line: step, loss, samples/s and time left.

On a terminal it redraws one line; otherwise (logs, CI) it prints a line now and then.
"""
from __future__ import annotations

import os
import sys
import time


def format_seconds(s: float) -> str:
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


class Progress:
    def __init__(self, total: int, start: int = 0, stream=None, width: int = 24, log_every_s: float | None = None):
        self.total = total
        self.start_step = start
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        # not on a terminal: a line every this many seconds ($SWARM_PROGRESS_SECONDS, 0 = every step)
        self.log_every_s = log_every_s if log_every_s is not None else float(os.environ.get("SWARM_PROGRESS_SECONDS", 15))
        self.t0 = time.monotonic()
        self.last_log = -1e9
        self.samples = 0

    def update(self, step: int, loss: float, samples: int, extra: str = "") -> None:
        """Report that step `step` (1-based count of finished steps) is done."""
        self.samples += samples
        now = time.monotonic()
        elapsed = now - self.t0
        rate = self.samples / elapsed if elapsed > 0 else 0.0
        done = step - self.start_step
        left = self.total - step
        eta = elapsed / done * left if done else 0.0
        frac = step / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        line = (f"step {step}/{self.total} [{bar}] loss {loss:.4g}  {rate:.1f} samples/s  "
                f"elapsed {format_seconds(elapsed)}  eta {format_seconds(eta)}{extra}")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            if step >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif step >= self.total or step == self.start_step + 1 or now - self.last_log >= self.log_every_s:
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last_log = now

    def message(self, text: str) -> None:
        """Print a line without breaking the progress line."""
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()
