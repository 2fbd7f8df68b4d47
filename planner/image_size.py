"""The size of a network's input image: width by height, as darknet's [net] `width` and `height`.

    ImageSize.parse("608x352")   # ImageSize(width=608, height=352)
    ImageSize.parse("416")       # ImageSize(width=416, height=416)
    ImageSize.of(128).hw         # (128, 128): (H, W), the order of a tensor's last two axes

Written to JSON (plans, profiles, checkpoints) as an int when square, as before non-square
sizes existed, and as "WxH" otherwise; `of` reads either back.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSize:
    """An input image's width and height in pixels (both at least 1)."""

    width: int
    height: int

    def __post_init__(self) -> None:
        if not (isinstance(self.width, int) and isinstance(self.height, int)):
            raise TypeError(f"ImageSize takes whole numbers, got {self.width!r} x {self.height!r}")
        if self.width < 1 or self.height < 1:
            raise ValueError(f"width and height must be at least 1, got {self.width}x{self.height}")

    @classmethod
    def parse(cls, text: str) -> "ImageSize":
        """"N" (N x N) or "WxH"; a ValueError saying what is wrong otherwise."""
        parts = text.strip().lower().split("x")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"'{text}' is not a size: give N (a square) or WxH, such as 416 or 608x352")
        numbers = [int(p) for p in parts]
        return cls(numbers[0], numbers[-1])

    @classmethod
    def of(cls, value) -> "ImageSize":
        """An ImageSize from what plans, profiles, checkpoints and job specs hold: an int
        (square), "N" or "WxH" text, [W, H], {"width": W, "height": H}, or an ImageSize."""
        if isinstance(value, ImageSize):
            return value
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not an image size")
        if isinstance(value, int):
            return cls(value, value)
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, dict) and set(value) == {"width", "height"}:
            return cls(int(value["width"]), int(value["height"]))
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
            return cls(value[0], value[1])
        raise ValueError(f"{value!r} is not an image size")

    @property
    def hw(self) -> tuple[int, int]:
        """(height, width): the order of a map's rows and columns."""
        return self.height, self.width

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def is_square(self) -> bool:
        return self.width == self.height

    def to_json(self) -> int | str:
        return self.width if self.is_square else f"{self.width}x{self.height}"

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"
