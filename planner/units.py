"""Reading and printing sizes, rates and durations the way people write them ("1 GiB", "100 Mbit/s")."""
from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": 1024**3,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value, what: str = "size") -> int:
    """Bytes from a number (taken as bytes) or a string such as "1 GiB", "512MB", "900 MiB"."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size such as \"1 GiB\", got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{what}: a size cannot be negative ({value})")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(f"{what}: expected a size such as \"1 GiB\" or \"512 MB\", got {value!r}")


def mbit_to_bytes_per_s(mbps: float) -> float:
    return mbps * 1e6 / 8


def format_bytes(n: float) -> str:
    """1.3 GiB, 870 MiB, 12 KiB: binary units, three significant figures."""
    n = float(n)
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """Short durations for tables: 850 us, 12.3 ms, 1.42 s, 3 min 5 s."""
    if s != s:
        return "-"
    if s == float("inf"):
        return "inf"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m} min {sec} s"


def format_rate(bytes_per_s: float) -> str:
    mbps = bytes_per_s * 8 / 1e6
    return f"{mbps / 1000:.3g} Gbit/s" if mbps >= 1000 else f"{mbps:.3g} Mbit/s"
