"""What mapping a micro-batch's largest blocks afresh costs this device (swarm.host.malloc.map_large,
planner.mapping): measured with its profile, kept in it as "map_cpu_s_per_byte".

The blocks are mapped here with the mmap module, as glibc maps a block of MAPPED_FROM or more
(private, anonymous, in the kernel's small pages), not through malloc: glibc serves such a request
from a free chunk of its heap when one holds it, and a profile runs after work that grew the
heap, so a pass asked to map often mapped nothing. Three measures in one process that had built
yolov2-16 at 416 gave 3e-11, 0 and 3e-10 s a byte; mapped here, 0.9-1.8e-10.
"""
from __future__ import annotations

import mmap
import statistics
import time

import torch

from swarm.host import malloc

# the block sizes a micro-batch's maps have, as fractions of MAPPED_FROM
SHAPE = (1.1, 2.8, 1.7, 5.5, 4.3, 11.2, 2.8, 1.1)


def _fresh(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def map_cost(rounds: int = 9) -> float:
    """Seconds of this thread's CPU per byte that mapping a block afresh adds to a pass: blocks
    of the sizes a micro-batch's maps have, held together and freed as a forward and backward
    hold them, written and read; mapped afresh and unmapped on free, against the same blocks
    kept mapped (the median of `rounds` paired differences). 0 where this process cannot map
    (swarm.host.malloc.can_map)."""
    if not malloc.can_map():
        return 0.0
    sizes = [int(malloc.MAPPED_FROM * f) // 4 * 4 for f in SHAPE]
    kept = [_fresh(n) for n in sizes]

    def one_pass(fresh: bool) -> float:
        t0 = time.thread_time()  # this thread's CPU, user and system: the kernel zeroes the pages here
        held = []
        for n, block in zip(sizes, kept):  # a forward: each block written as it is made, all kept
            block = _fresh(n) if fresh else block
            held.append((block, torch.frombuffer(block, dtype=torch.float32).fill_(1.0)))
        while held:  # a backward: each read, then freed
            block, view = held.pop()
            view.sum()
            del view
            if fresh:
                block.close()
        return time.thread_time() - t0

    try:
        one_pass(False)  # the kept blocks faulted in
        differences = [one_pass(True) - one_pass(False) for _ in range(rounds)]
    finally:
        for block in kept:
            block.close()
    return max(0.0, statistics.median(differences)) / sum(sizes)
