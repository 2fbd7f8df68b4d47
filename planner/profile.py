"""A device profile as the profiler writes it: plain JSON-ready data that the planner reads.

    {"version": 1, "kind": "swarm-profile",
     "device": {"fingerprint": "3f2a...", "cpu": "...", "cores": 2, "memory": 25000000000, "threads": 1},
     "model": "yolov2-16", "img_size": 128, "classes": 5, "layers": 17,   # img_size: N or "WxH"
     "costs": {"batch_sizes": [1, 2, 4], "fwd": [[...], ...], "bwd": ..., "update": ..., "loss_fwd": ..., "loss_bwd": ...},
     "act_bytes": [...],               # per layer, bytes kept for the backward per sample
     "step_time": {"1": 0.05, ...},    # a whole local training step at each batch size
     "peak_bytes": {"1": 1.2e8, ...},  # its peak resident memory above runtime_bytes
     "runtime_bytes": 3.1e8,           # the idle process with torch initialised, without the model
     "repeats": 3, "created": "2025-01-01T12:00:00"}
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.costs import CostTable
from planner.image_size import ImageSize
from planner.model_desc import ModelDesc

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile that cannot be used for this model; the message says why."""


@dataclass
class DeviceProfile:
    model: str
    img_size: ImageSize
    costs: CostTable
    act_bytes: list[float]
    device: dict = field(default_factory=dict)
    classes: int | None = None
    step_time: dict[int, float] = field(default_factory=dict)
    peak_bytes: dict[int, float] = field(default_factory=dict)
    runtime_bytes: float = 0.0
    repeats: int = 1
    created: str = ""

    def __post_init__(self) -> None:
        self.img_size = ImageSize.of(self.img_size)  # an int is a square

    def check_matches(self, desc: ModelDesc) -> None:
        where = f"the profile of {self.device.get('name') or self.device.get('fingerprint', 'a device')}"
        if self.model != desc.name or self.img_size != desc.img_size:
            raise ProfileError(f"{where} is for {self.model} at {self.img_size}, "
                               f"not {desc.name} at {desc.img_size}; profile this model and size")
        if self.costs.num_layers != len(desc.layers) or len(self.act_bytes) != len(desc.layers):
            raise ProfileError(f"{where} has {self.costs.num_layers} layers but {desc.name} has {len(desc.layers)}")

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, "kind": "swarm-profile", "device": self.device, "model": self.model,
                "img_size": self.img_size.to_json(), "classes": self.classes, "layers": self.costs.num_layers,
                "costs": self.costs.to_dict(), "act_bytes": list(self.act_bytes),
                "step_time": {str(k): v for k, v in self.step_time.items()},
                "peak_bytes": {str(k): v for k, v in self.peak_bytes.items()},
                "runtime_bytes": self.runtime_bytes, "repeats": self.repeats, "created": self.created}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProfile":
        if not isinstance(d, dict) or d.get("kind") != "swarm-profile":
            raise ProfileError("not a swarm profile (written by `swarm profile`)")
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile version {d.get('version')} is not supported (this swarm reads {PROFILE_VERSION}); "
                               "profile again with `swarm profile`")
        try:
            return cls(model=str(d["model"]), img_size=ImageSize.of(d["img_size"]), costs=CostTable.from_dict(d["costs"]),
                       act_bytes=[float(x) for x in d["act_bytes"]], device=dict(d.get("device") or {}),
                       classes=d.get("classes"),
                       step_time={int(k): float(v) for k, v in (d.get("step_time") or {}).items()},
                       peak_bytes={int(k): float(v) for k, v in (d.get("peak_bytes") or {}).items()},
                       runtime_bytes=float(d.get("runtime_bytes") or 0.0), repeats=int(d.get("repeats", 1)),
                       created=str(d.get("created", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed profile: {exc}") from None
