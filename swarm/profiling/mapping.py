"""What mapping a micro-batch's largest blocks afresh costs this device (swarm.host.malloc.map_large,
planner.mapping): measured with its profile, kept in it as "map_cpu_s_per_byte"."""
from __future__ import annotations

import statistics
import time

import torch

from swarm.host import malloc


def map_cost(rounds: int = 5) -> float:
    """Seconds of this process's CPU per byte of its largest blocks that map_large adds to a
    pass: blocks of the sizes a micro-batch's maps have, held together and freed as a forward
    and backward hold them, written and read, mapped afresh against served from the heap (the
    medians of `rounds`). 0 where this process cannot map."""
    if not malloc.can_map():
        return 0.0
    sizes = [int(malloc.MAPPED_FROM * f) // 4 for f in (1.1, 2.8, 1.7, 5.5, 4.3, 11.2, 2.8, 1.1)]  # floats

    def one_pass(mapped: bool) -> float:
        malloc.map_large(mapped)
        t0 = time.thread_time()  # this thread's CPU, user and system
        held = []
        for n in sizes:  # a forward: each block written as it is made, all kept
            held.append(torch.empty(n).fill_(1.0))
        while held:  # a backward: each read, then freed
            held.pop().sum()
        return time.thread_time() - t0

    malloc.release()  # glibc maps a block only where no free room of its heap holds it: mapped first
    try:
        mapped = statistics.median(one_pass(True) for _ in range(rounds))
        one_pass(False)  # the heap grown to hold them
        heap = statistics.median(one_pass(False) for _ in range(rounds))
    finally:
        malloc.map_large(False)
    return max(0.0, mapped - heap) / (4 * sum(sizes))
