"""The compute lock a device's stages share: a wait on the network lets it go, also when the
wait happens in a thread computing on behalf of the holder (autograd's own thread runs a
CUDA backward, and its group BatchNorm exchanges, while the compute thread waits)."""
from __future__ import annotations

import threading

from swarm.execution.threads import ComputeLock


def _others_can_take(lock: ComputeLock, wait: float = 2.0) -> bool:
    took = []

    def other():
        if lock._lock.acquire(timeout=wait):
            took.append(True)
            lock._lock.release()
    t = threading.Thread(target=other, daemon=True)
    t.start()
    t.join(5)
    return bool(took)


def test_the_holder_lets_go_while_it_waits_and_holds_it_again_after():
    lock = ComputeLock()
    with lock:
        assert not _others_can_take(lock, 0.3)
        with lock.released():
            assert _others_can_take(lock)
        assert not _others_can_take(lock, 0.3)
    assert _others_can_take(lock)


def test_a_thread_computing_for_the_holder_lets_go_for_it():
    lock = ComputeLock()
    seen = {}

    def helper():  # as autograd's thread: runs the backward, and its exchange, for the holder
        with lock.released():
            seen["free while waiting"] = _others_can_take(lock)
        seen["held again after"] = not _others_can_take(lock, 0.3)

    def holder():
        with lock:
            t = threading.Thread(target=helper, daemon=True)
            t.start()
            t.join(10)
            seen["helper returned"] = not t.is_alive()
    h = threading.Thread(target=holder, daemon=True)
    h.start()
    h.join(15)
    assert not h.is_alive() and seen == {"free while waiting": True, "held again after": True, "helper returned": True}
    assert _others_can_take(lock)  # the holder's own release let it go
