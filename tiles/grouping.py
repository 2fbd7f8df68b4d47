"""Grouping profiles: the boundaries where tiles synchronise, forward and backward (pure data).

A tiles stage runs layers [first, last). Boundary b is the map entering layer b, as in
planner.plan. Forward, tiles exchange activation halos at the boundaries in `forward`
(always including `first`, where the stage input arrives as each tile's input rectangle);
a forward group runs from one sync to the next and recomputes overlapping regions inside.
Backward, tiles exchange delta halos at the boundaries in `backward` (always including
`last`, where each tile's owned part of dL/d(output) arrives); a backward group runs down
from one sync to the next lower one. The default backward profile mirrors the forward
groups (each forward group's end is a backward sync), as the paper draws it.

    Grouping.parse("0,4,8", first=0, last=17)   # forward groups 0-3, 4-7, 8-16
    Grouping.every_layer(0, 17)                  # no grouping: sync at every layer
    Grouping.one_group(0, 17)                    # one fused group forward and backward
"""
from __future__ import annotations

from dataclasses import dataclass

from tiles.regions import TilingError


def parse_grid(text: str) -> tuple[int, int]:
    """'RxC' (rows x columns), e.g. '2x3' -> (2, 3)."""
    parts = text.lower().replace("*", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise TilingError(f"--grid takes ROWSxCOLS such as 2x2 or 2x3, got '{text}'")
    rows, cols = (int(p) for p in parts)
    if rows < 1 or cols < 1:
        raise TilingError(f"--grid needs at least one row and one column, got '{text}'")
    return rows, cols


@dataclass(frozen=True)
class Grouping:
    first: int
    last: int
    forward: tuple[int, ...]  # sorted; forward[0] == first; all < last
    backward: tuple[int, ...]  # sorted; backward[-1] == last; all > first

    def __post_init__(self) -> None:
        where = f"layers {self.first}-{self.last - 1}"
        if self.last <= self.first:
            raise TilingError(f"a tiles stage needs at least one layer (first {self.first}, last {self.last})")
        fwd, bwd = list(self.forward), list(self.backward)
        if fwd != sorted(set(fwd)) or bwd != sorted(set(bwd)):
            raise TilingError("sync boundaries must be sorted and distinct")
        if not fwd or fwd[0] != self.first or fwd[-1] >= self.last:
            raise TilingError(f"forward syncs {fwd} must include the stage's first layer {self.first} and lie in {where}")
        if not bwd or bwd[-1] != self.last or bwd[0] <= self.first:
            raise TilingError(f"backward syncs {bwd} must include the stage end {self.last} and lie in "
                              f"{self.first + 1}-{self.last}")

    @classmethod
    def make(cls, first: int, last: int, forward, backward=None) -> "Grouping":
        """Forward syncs (`first` is added); backward syncs default to the mirror."""
        fwd = tuple(sorted(set(int(b) for b in forward) | {first}))
        if backward is None:
            bwd = tuple(sorted(set(fwd[1:]) | {last}))
        else:
            bwd = tuple(sorted(set(int(b) for b in backward) | {last}))
        return cls(first, last, fwd, bwd)

    @classmethod
    def every_layer(cls, first: int, last: int) -> "Grouping":
        return cls.make(first, last, range(first, last))

    @classmethod
    def one_group(cls, first: int, last: int) -> "Grouping":
        return cls.make(first, last, [first])

    @classmethod
    def parse(cls, text: str, first: int, last: int) -> "Grouping":
        """`all`, `none` (one group), or comma-separated layer numbers where forward groups
        start, e.g. `0,4,8`. The stage's first layer is always a sync."""
        text = text.strip().lower()
        if text in ("all", "every"):
            return cls.every_layer(first, last)
        if text in ("none", "one"):
            return cls.one_group(first, last)
        layers = []
        for part in text.split(","):
            part = part.strip()
            if not part.isdigit():
                raise TilingError(f"--sync takes 'all', 'none' or layer numbers like 0,4,8; '{part}' is not a layer number")
            layers.append(int(part))
        bad = [b for b in layers if not first <= b < last]
        if bad:
            raise TilingError(f"--sync layer(s) {', '.join(map(str, bad))} are not in the tiles stage "
                              f"(layers {first}-{last - 1})")
        return cls.make(first, last, layers)

    # ---- groups ------------------------------------------------------------------
    def forward_groups(self) -> list[tuple[int, int]]:
        """(s, e): layers s..e-1 run fused after a sync at s."""
        ends = list(self.forward[1:]) + [self.last]
        return list(zip(self.forward, ends))

    def backward_groups(self) -> list[tuple[int, int]]:
        """(s, e): after a delta sync at e, layers e-1 down to s run fused."""
        starts = [self.first] + list(self.backward[:-1])
        return list(zip(starts, self.backward))

    def describe(self) -> str:
        def show(groups):
            return " ".join(f"[{s}-{e - 1}]" for s, e in groups)
        return f"forward groups {show(self.forward_groups())}, backward groups {show(self.backward_groups())}"

    def to_dict(self) -> dict:
        """The Plan's stage fields: `syncs` and `back_syncs`."""
        return {"syncs": list(self.forward), "back_syncs": list(self.backward)}
