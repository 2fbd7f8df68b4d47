"""Which torch device this machine computes on: its accelerator when torch can use one, else
its CPU; and what exact, repeatable results on it take."""
from __future__ import annotations

import torch

from swarm.errors import SwarmError

ACCELERATORS = ("cpu", "cuda")


def compute_device(choice: str | None = None) -> torch.device:
    """The device for `choice` ("cpu", "cuda", or None: CUDA when torch sees a GPU, else the CPU).

    On CUDA, cuDNN is told to use deterministic kernels and not to pick them by timing
    (cudnn.deterministic, no benchmark): the same seed then gives the same weights run after
    run, and float64 runs agree with the CPU to rounding, at the cost of some speed in
    convolutions (cuDNN's fastest kernels for a shape are not always the deterministic ones)."""
    if choice is None:
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice not in ACCELERATORS:
        raise SwarmError(f"--accelerator takes {' or '.join(ACCELERATORS)}, not '{choice}'")
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise SwarmError("--accelerator cuda: torch sees no CUDA device on this machine (a CPU build of torch, "
                             "or no driver); use --accelerator cpu")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return torch.device(choice)


HOST = torch.device("cpu")  # where a tensor goes to cross the wire or be saved


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory: itself when it is there already, else one copy. From CUDA the copy
    lands in a pinned (page-locked) buffer, from torch's cache of them, and runs `non_blocking`
    on a copy stream of its own once the work queued before the call (which produced `t`) is
    done: called from a thread other than the compute thread, it runs beside the compute
    queued after it. It returns once the bytes are there. Pinning needs CUDA: host tensors are
    never pinned."""
    if t.device == HOST:
        return t
    if t.device.type != "cuda":
        return t.to(HOST)
    buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    stream = _copy_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        buffer.copy_(t, non_blocking=True)
    stream.synchronize()
    return buffer


_COPY_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _copy_stream(device: torch.device):
    """One side stream per CUDA device for copies to the host."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def plan_device(facts: dict) -> torch.device:
    """Where a plan's device computes: its "accelerator" fact, else the host CPU (a plan that
    says nothing was made from CPU figures)."""
    return compute_device(facts["accelerator"]) if facts.get("accelerator") else HOST
