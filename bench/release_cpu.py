"""CPU of one `swarm.host.malloc.release()` (a full collection, then the heap's free pages given
back) in a process that imported what an agent's train and profile jobs import, with torch's
modules in the collector's walks and set out of them (`malloc.freeze_imports`, as an agent
does after its first torch job's import), alternating, medians.

    PYTHONPATH=. python bench/release_cpu.py [--rounds 9]

An agent calls release() at each run's start and end and a profile at each memory reading.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def release_cpu() -> float:
    from swarm.host import malloc

    start = time.process_time()
    malloc.release()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    import swarm.execution.train_job  # noqa: F401  (torch, and what a train job brings)
    import swarm.profiling.profiler  # noqa: F401
    from swarm.host import malloc

    walked, frozen = [], []
    for _ in range(args.rounds):
        gc.unfreeze()
        count = len(gc.get_objects())
        walked.append(release_cpu())
        malloc.freeze_imports()
        frozen.append(release_cpu())
    print(f"objects the collector walks: {count} as imported, {len(gc.get_objects())} once frozen")
    print(f"release(): {statistics.median(walked) * 1e3:.1f} ms CPU walking them, "
          f"{statistics.median(frozen) * 1e3:.1f} ms frozen (medians of {args.rounds}, alternating)")


if __name__ == "__main__":
    main()
