"""Reading darknet .cfg files into sections, with errors that name the file and line."""
from __future__ import annotations

from dataclasses import dataclass, field

from swarm.errors import SwarmError

KNOWN_SECTIONS = {
    "net", "network", "convolutional", "conv", "maxpool", "max", "avgpool", "avg",
    "route", "reorg", "connected", "dropout", "region", "softmax", "cost",
    "shortcut", "upsample", "yolo", "scale_channels", "sam", "crop", "detection",
}
ALIASES = {"network": "net", "conv": "convolutional", "max": "maxpool", "avg": "avgpool"}


@dataclass
class Section:
    """One `[name]` block: its options as strings, and where it came from."""

    name: str
    line: int
    options: dict[str, str] = field(default_factory=dict)
    source: str = "<cfg>"
    used: set[str] = field(default_factory=set)

    def where(self) -> str:
        return f"{self.source}:{self.line} [{self.name}]"

    def _raw(self, key: str) -> str | None:
        self.used.add(key)
        return self.options.get(key)

    def _get(self, key: str, default, kind, noun: str):
        raw = self._raw(key)
        if raw is None:
            if default is None:
                raise SwarmError(f"{self.where()}: missing '{key}='")
            return default
        try:
            return kind(raw)
        except ValueError:
            raise SwarmError(f"{self.where()}: '{key}={raw}' is not {noun}") from None

    def get_int(self, key: str, default: int | None = None) -> int:
        return self._get(key, default, int, "an integer")

    def get_float(self, key: str, default: float | None = None) -> float:
        return self._get(key, default, float, "a number")

    def get_str(self, key: str, default: str) -> str:
        raw = self._raw(key)
        return default if raw is None else raw.strip()

    def get_ints(self, key: str) -> list[int]:
        raw = self._raw(key)
        if raw is None or not raw.strip():
            raise SwarmError(f"{self.where()}: missing '{key}='")
        try:
            return [int(x) for x in raw.split(",") if x.strip()]
        except ValueError:
            raise SwarmError(f"{self.where()}: '{key}={raw}' is not a list of integers") from None

    def get_floats(self, key: str) -> list[float]:
        raw = self._raw(key)
        if raw is None or not raw.strip():
            raise SwarmError(f"{self.where()}: missing '{key}='")
        try:
            return [float(x) for x in raw.split(",") if x.strip()]
        except ValueError:
            raise SwarmError(f"{self.where()}: '{key}={raw}' is not a list of numbers") from None


def parse_cfg(text: str, source: str = "<cfg>") -> list[Section]:
    """Split darknet .cfg text into sections. Comments start with # or ;."""
    sections: list[Section] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise SwarmError(f"{source}:{lineno}: section header '{line}' has no closing ']'")
            name = line[1:-1].strip().lower()
            if name not in KNOWN_SECTIONS:
                known = ", ".join(sorted(KNOWN_SECTIONS - set(ALIASES)))
                raise SwarmError(f"{source}:{lineno}: unknown section [{name}]; swarm knows {known}")
            sections.append(Section(ALIASES.get(name, name), lineno, source=source))
            continue
        if "=" not in line:
            raise SwarmError(f"{source}:{lineno}: expected 'key=value' or '[section]', got '{line}'")
        if not sections:
            raise SwarmError(f"{source}:{lineno}: option '{line}' comes before any [section]")
        key, value = line.split("=", 1)
        sections[-1].options[key.strip().lower()] = value.strip()
    if not sections or sections[0].name != "net":
        raise SwarmError(f"{source}: a darknet .cfg must start with a [net] section")
    if len(sections) == 1:
        raise SwarmError(f"{source}: the [net] section is not followed by any layer")
    return sections


def set_options(text: str, sections: list[Section], edits: list[tuple[int, str, str]]) -> str:
    """`text` with option `key=value` set in section n (an index into `sections`, parsed from
    `text`) for each (n, key, value) of `edits`: the option's line replaced where the section
    has it, added under the section's header where not. The rest, comments included, unchanged."""
    lines = text.splitlines()
    starts = [s.line - 1 for s in sections] + [len(lines)]  # 0-based header lines
    by_section: dict[int, list[tuple[str, str]]] = {}
    for n, key, value in edits:
        by_section.setdefault(n, []).append((key, value))
    for n in sorted(by_section, reverse=True):  # bottom up: the header lines above stay where they are
        header, end = starts[n], starts[n + 1]
        for key, value in by_section[n]:
            for i in range(header + 1, end):
                stripped = lines[i].split("#", 1)[0].split(";", 1)[0]
                if "=" in stripped and stripped.split("=", 1)[0].strip().lower() == key:
                    lines[i] = f"{key}={value}"
                    break
            else:
                lines.insert(header + 1, f"{key}={value}")
                end += 1
    return "\n".join(lines) + "\n"
