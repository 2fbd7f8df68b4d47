"""What kind of accelerator this device has, found without importing torch."""
from __future__ import annotations

from pathlib import Path


def accelerator() -> str:
    """"cuda" on NVIDIA GPUs and Jetsons, "cpu" otherwise."""
    if Path("/etc/nv_tegra_release").exists() or Path("/proc/driver/nvidia/version").exists() \
            or Path("/dev/nvidia0").exists():
        return "cuda"
    return "cpu"
