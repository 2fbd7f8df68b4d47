"""The files a user names, looked at without torch: a command refuses one that cannot be what
it asks for (missing, a text file given as a checkpoint, a folder without images) before it
loads torch, which takes seconds here and more on a small device."""
from __future__ import annotations

import zipfile
from pathlib import Path

from swarm.errors import SwarmError

TORCH_HEADS = (b"PK\x03\x04", b"\x80")  # how torch files begin: a zip archive, or the old pickle format
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")  # what swarm detect reads


def check_checkpoint(path: str | Path) -> None:
    """A SwarmError, in load_checkpoint's words, for a checkpoint that is not there or is no
    torch file at all; what torch must read to judge is left to load_checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise SwarmError(f"checkpoint {path} does not exist")
    if not _head(path).startswith(TORCH_HEADS):
        raise SwarmError(f"{path} is not a swarm checkpoint: {describe_file(path)}")


def check_weights(path: str | Path) -> None:
    """The same for `swarm train --weights`: darknet weights or a swarm checkpoint
    (load_initial_weights reads them)."""
    from swarm.zoo.darknet_weights import looks_like_darknet

    path = Path(path)
    if not path.is_file():
        raise SwarmError(f"weights file {path} does not exist")
    head = _head(path)
    if not head.startswith(TORCH_HEADS) and not looks_like_darknet(head, path.stat().st_size):
        raise SwarmError(f"{path} is neither darknet weights nor a swarm checkpoint: {describe_file(path)}")


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(16)
    except OSError:
        return b""  # describe_file says why


def describe_file(path: Path, error: BaseException | None = None) -> str:
    """What a file that torch cannot read as a checkpoint looks like, in a few words."""
    from swarm.zoo.darknet_weights import looks_like_darknet

    try:
        with open(path, "rb") as f:
            head = f.read(64)
        size = path.stat().st_size
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    if not head:
        return "it is an empty file"
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError):
            return "it is a damaged or cut-short zip archive (torch's format), perhaps an interrupted copy"
        if any(name.endswith("data.pkl") for name in names):
            if error is not None and "weights only load failed" in str(error).lower():
                return ("it is a torch file holding Python objects besides tensors (a whole pickled model?); "
                        "swarm reads plain dictionaries of tensors")
            return f"it is a damaged torch file ({type(error).__name__ if error else 'unreadable'})"
        return f"it is a zip archive of {len(names)} file(s), not a torch file"
    if head.startswith(b"\x80"):
        return "it is a Python pickle that torch cannot read as tensors (an old-format or damaged torch file?)"
    for magic, kind in ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"\x1f\x8b", "a gzip file")):
        if head.startswith(magic):
            return f"it is {kind}"
    if looks_like_darknet(head, size):
        return "it looks like darknet weights, not a torch file (give it to swarm train --weights)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a character cut at the end of `head` still reads as text
        text = head[:exc.start].decode("utf-8") if exc.start >= len(head) - 3 else None
    if text and all(c.isprintable() or c in "\r\n\t" for c in text):
        first = text.strip().splitlines()[0][:40] if text.strip() else ""
        return f"it is a text file (starting {first!r})"
    return f"it is not a torch file (it starts with bytes {head[:8].hex(' ')})"


def find_images(paths: list[str]) -> list[Path]:
    """The image files named, and those in the folders named (sorted, not recursing)."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            inside = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not inside:
                raise SwarmError(f"{path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise SwarmError(f"{path}: no such file or folder")
    return found
