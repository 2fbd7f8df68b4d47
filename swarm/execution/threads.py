"""Compute threads and their job: every wait a compute thread makes ends when the task that
started the thread is cancelled (a stop signal, a superseded epoch), so that no thread is
left blocked behind an abandoned step.

A compute thread is started by `trio.to_thread.run_sync`, which cannot interrupt it: a
cancelled job waits for its threads to return. So a thread never blocks on anything that
only the job's own progress would end:

- calls into the event loop (the group BatchNorm exchange) run in the thread's own task
  (`call_in_loop`), so they see its cancellation and raise `trio.Cancelled` in the thread;
- the compute lock is taken in short waits that check for cancellation (`ComputeLock`);
- between layers a forward checks for cancellation (`stop_if_cancelled`, a forward
  pre-hook), so that a long stage stops within a layer rather than at its end.
"""
from __future__ import annotations

import threading

import trio

LOCK_POLL_S = 0.05  # how often a thread waiting for the compute lock looks for cancellation


def check_cancelled() -> None:
    """Raise trio.Cancelled in a compute thread whose task was cancelled; nothing elsewhere."""
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:  # not a thread trio started (autograd's own, a test's)
        pass


def stop_if_cancelled(module, inputs) -> None:
    """A forward pre-hook: a cancelled job's compute stops at the next layer."""
    check_cancelled()


def call_in_loop(afn, *args, token: trio.lowlevel.TrioToken):
    """`await afn(*args)` in the event loop, from a thread. In a thread trio started, it runs
    in the task that waits for the thread, and so is cancelled with it; from any other thread
    (no such task) it runs as a system task of `token`'s loop."""
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:
        return trio.from_thread.run(afn, *args, trio_token=token)
    return trio.from_thread.run(afn, *args)


class ComputeLock:
    """One stage computes at a time on a device; a thread waiting on the network lets go,
    so two stages on one device cannot block each other. Waiting for it ends with
    trio.Cancelled when the waiting thread's task is cancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self) -> None:
        while not self._lock.acquire(timeout=LOCK_POLL_S):
            check_cancelled()
        self._owner = threading.get_ident()

    def release(self) -> None:
        """Let go, if this thread holds it (a wait cancelled on the way back does not)."""
        if self._owner == threading.get_ident():
            self._owner = None
            self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def released(self):
        """Let go while waiting on the network, and take it back after: for the thread that
        holds it, or for a thread computing on its behalf while it waits (on CUDA, autograd
        runs a backward, and so a group BatchNorm exchange, in a thread of its own, while the
        compute thread that holds the lock waits for the backward to finish)."""
        lock = self

        class _Released:
            def __enter__(self_inner):
                self_inner.owner = lock._owner
                if self_inner.owner is not None:
                    lock._owner = None
                    lock._lock.release()

            def __exit__(self_inner, *exc):
                if self_inner.owner is not None:
                    lock.acquire()
                    lock._owner = self_inner.owner
        return _Released()
