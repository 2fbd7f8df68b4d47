"""Profiles on disk: this device's fingerprint, where its profiles are cached, reading and writing one.

This device's facts and their fingerprint (another CPU, quota, thread count, torch or
accelerator means profiling again), where a profile is cached in the state directory (per
fingerprint, model, image size, classes and .cfg), and reading and writing one."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
from pathlib import Path

from planner.image_size import ImageSize
from planner.profile import DeviceProfile, ProfileError
from swarm.errors import SwarmError
from swarm.host import malloc
from swarm.host.resources import cpu_quota, usable_cores, usable_memory

PROFILE_METHOD = 5  # 4: layers timed in CPU time under a quota, fitted to whole steps; the tiles executor's
                    # overhead; 5: saved bytes of in-place activations and byte-coded max-pools
                    # (profiles measured otherwise are measured again)


def default_state_dir() -> Path:
    """Where swarm keeps its state (swarm.host.state: --state-dir, $SWARM_STATE_DIR, /var/lib/swarm
    as root, else ~/.local/share/swarm); profiles go to its profiles/ folder."""
    from swarm.host.state import default_state_dir as runtime_state_dir

    return runtime_state_dir()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_facts(threads: int, accelerator: dict | None = None) -> dict:
    """What decides this device's speed, and a fingerprint of it (cached profiles are per
    fingerprint: other CPU, quota, thread count, torch or accelerator means profiling again).
    `accelerator`: what `accelerator_identity` says of the one the layers run on (None: the CPU)."""
    facts = {"cpu": _cpu_name(), "machine": platform.machine(), "cores": usable_cores(), "cpu_quota": cpu_quota(),
             "threads": threads, "torch": _torch_version(), "allocator": malloc.allocator()}
    if facts["cpu_quota"] is not None:
        facts["timing"] = "quota"  # measured with QuotaClock
    if accelerator is not None:
        facts["accelerator"] = dict(accelerator)
    facts["method"] = PROFILE_METHOD
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]
    facts.update(fingerprint=digest, memory=usable_memory(), name=platform.node())
    return facts


def _torch_version() -> str:
    """torch's version without importing it (reading a cached profile should not load torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        import torch

        return torch.__version__


def cache_path(state_dir: Path, fingerprint: str, model: str, img_size: ImageSize, classes: int | None,
               cfg_text: str) -> Path:
    cfg = hashlib.sha256(cfg_text.encode()).hexdigest()[:8]
    return Path(state_dir) / "profiles" / fingerprint / f"{model}-{img_size.to_json()}-c{classes}-{cfg}.json"


def read_profile(path: Path) -> DeviceProfile:
    try:
        return DeviceProfile.from_dict(json.loads(Path(path).read_text()))
    except OSError as exc:
        raise SwarmError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SwarmError(f"profile {path} is not valid JSON: {exc}") from None
    except ProfileError as exc:
        raise SwarmError(f"{path}: {exc}") from None


def write_profile(profile: DeviceProfile, path: Path) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # writers may race
        tmp.write_text(json.dumps(profile.to_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        raise SwarmError(f"cannot write profile {path}: {exc.strerror or exc}; choose another --state-dir") from None
