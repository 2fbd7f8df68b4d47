"""The accelerator a profile computes on: what it is, its memory, its copies to and from the host.

What it is in the cluster file's words (`accelerator_identity`), whether a profile job can
use the one its agent offers (`usable_accelerator`), a training step's memory on it
(`AcceleratorMemory`), and the rate of the copies that take a stage's messages between it
and host memory (`copy_gbps`)."""
from __future__ import annotations

from swarm.profiling.clocks import Budget, Stopwatch, median_time


def accelerator_identity(device) -> dict | None:
    """The accelerator a torch device is, in the cluster file's words (None: the host CPU):
    {"kind": "cuda", "note": its name, "shared_memory": whether it shares the host's memory}.
    A Jetson's GPU is integrated (torch says so): one memory with its CPU."""
    if device.type != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"kind": "cuda", "note": props.name, "shared_memory": bool(props.is_integrated)}


def usable_accelerator(offered: str | None) -> str:
    """What a profile measures on: "cuda" where the agent offers it and torch can use it (an
    agent tells from the device's files, without torch), else "cpu"."""
    if offered != "cuda":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class AcceleratorMemory:
    """A step's memory on the device that computes. On the CPU: the host's resident memory.
    On a discrete GPU: the most torch allocated on it, out of its own memory (what is free
    there once CUDA is up is its budget). On an integrated one (a Jetson), CPU and GPU take
    from one memory: the host's share and the GPU's add up, against the device's one budget,
    counted once."""

    def __init__(self, device, accelerator: dict | None):
        self.device = device
        self.cuda = accelerator is not None
        self.shared = bool(accelerator and accelerator["shared_memory"])
        self.free = None
        if self.cuda:
            import torch

            torch.zeros(1, device=device)  # CUDA up: its context is not the model's
            self.free = torch.cuda.mem_get_info(device)[0]

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_peak(self, host_peak: float) -> float:
        """The step's peak bytes, given the host's above the runtime."""
        if not self.cuda:
            return host_peak
        import torch

        on_gpu = float(torch.cuda.max_memory_allocated(self.device))
        return host_peak + on_gpu if self.shared else on_gpu

    def budget(self) -> dict:
        """The accelerator's memory as a cluster file gives it: its own, or shared with the host."""
        return {"shared_memory": True} if self.shared else {"shared_memory": False, "memory": int(self.free)}


def copy_gbps(tensors, device, budget: Budget) -> float:
    """GB/s of the copies that take a stage's messages between host memory and `device`:
    each of `tensors` (the layers' outputs: what a stage takes in and gives out) taken to the
    device as an incoming message is, and brought back as an outgoing one is (`to_host`),
    median of `budget.repeats` passes over all of them, by the wall clock (copies run on streams of
    their own)."""
    from swarm.local.compute_device import HOST, to_host

    hosted = [to_host(t).contiguous() for t in tensors]
    nbytes = 2 * sum(t.numel() * t.element_size() for t in hosted)

    def there_and_back():
        for t in hosted:
            to_host(t.to(device, non_blocking=True, copy=True))

    there_and_back()  # warm up (pinned buffers, the copy stream)
    seconds = median_time(there_and_back, budget, Stopwatch(HOST))
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")
