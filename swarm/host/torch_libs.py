"""Loading torch's native library without stopping the event loop.

`import torch` loads libtorch_cpu.so (a few hundred MB of code) with the interpreter lock
held, as Python loads every extension's libraries. On a 0.1-core device that took 3.9 s, in
which no other thread of the process ran: an agent importing torch in a worker thread for its
first job answered no liveness probe, missed the coordinator's 2 s deadline and was taken
for dead (a profile of the mixed testbed failed that way and had to start again).
`preload` loads the library first through libc's dlopen, which ctypes calls with the lock
released; the import then finds it loaded. The longest stall of the importing agent's event
loop at 0.1 core went from 3.9 to 0.65 s.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading

# torch's own libraries, each after those it needs; the CUDA one is left to torch, which
# first loads the CUDA libraries it was built against
LIBRARIES = ("libc10.so", "libtorch_cpu.so")

_lock = threading.Lock()
_done = False


def preload() -> list[str]:
    """Load torch's CPU libraries, unless torch is imported already; the paths loaded now.
    Where they or libc's dlopen cannot be found, nothing happens and the import loads them
    as usual. Call it from a worker thread, before the import."""
    global _done
    with _lock:
        if _done or "torch" in sys.modules or not sys.platform.startswith("linux"):
            return []
        _done = True
        try:
            spec = importlib.util.find_spec("torch")
            dlopen = ctypes.CDLL(None).dlopen
        except (ImportError, ValueError, AttributeError, OSError):
            return []
        if spec is None or spec.origin is None:
            return []
        dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
        here = os.path.join(os.path.dirname(spec.origin), "lib")
        loaded = []
        for name in LIBRARIES:
            path = os.path.join(here, name)
            if os.path.exists(path) and dlopen(os.fsencode(path), os.RTLD_NOW):  # never closed: torch keeps it
                loaded.append(path)
        return loaded
