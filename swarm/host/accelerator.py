"""What kind of accelerator this device has, and its memory, found without importing torch."""
from __future__ import annotations

import subprocess
from pathlib import Path

SHARED = 0  # accelerator memory: none of its own (a CPU, or a GPU that shares the host's memory, as on a Jetson)
UNKNOWN = -1  # a GPU with memory of its own, how much not found


def accelerator() -> str:
    """"cuda" on NVIDIA GPUs and Jetsons, "cpu" otherwise."""
    if Path("/etc/nv_tegra_release").exists() or Path("/proc/driver/nvidia/version").exists() \
            or Path("/dev/nvidia0").exists():
        return "cuda"
    return "cpu"


def accelerator_memory(kind: str) -> int:
    """Bytes of memory the accelerator `kind` has of its own: SHARED for the CPU and for a
    Jetson's GPU (one memory with the CPU: the device's memory is all there is), a discrete
    GPU's total as nvidia-smi reports it (the first GPU), or UNKNOWN."""
    if kind != "cuda" or Path("/etc/nv_tegra_release").exists():
        return SHARED
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5)
        return int(out.stdout.split()[0]) * 2**20 if out.returncode == 0 else UNKNOWN  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return UNKNOWN
