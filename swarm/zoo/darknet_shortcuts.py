"""A .cfg's [shortcut]s that add a larger map, written with the subsampling as layers of its own, which every darknet reader computes alike."""
from __future__ import annotations

from planner.model_desc import ModelDesc
from swarm.zoo.build import shortcut_ratio
from swarm.zoo.darknet import parse_cfg

# pjreddie's darknet adds a from= map of another size as its shortcut_cpu (src/blas.c) does,
# and swarm's [shortcut] with it: the larger map taken at every k-th pixel (k = w1/w2), over
# the channels both maps have. Darknet's own resnet18 and resnet50 rely on it. AlexeyAB's
# darknet asserts that the sizes agree (parse_shortcut; past the assert its
# shortcut_multilayer_cpu adds element by element in memory order), and OpenCV's reader
# (an Eltwise sum, with the channels of the map before the [shortcut]) refuses them. So each
# such from= map is written as layers that all of them read, and read alike:
#
#   [route]    layers=<from>                   the larger map (C1, k*H, k*W)
#   [maxpool]  size=1 stride=k padding=0       its every k-th pixel (C1, H, W): windows of one
#                                              pixel, no padding in darknet, OpenCV or swarm
#   [route]    layers=<the map before>         back to the [shortcut]'s own input (C2, H, W)
#   [shortcut] from=<the maxpool>              maps of one size, added over min(C1, C2) channels
#
# Every layer index after them (route layers=, shortcut, scale_channels and sam from=, yolo
# embedding_layer=; counted back or from the start) moves on past the added layers, and a
# comment that numbers a layer ("# 10" above it) says its new number. The added layers have
# no weights: the .weights file stays the same.
REFERENCES = {"route": "layers", "shortcut": "from", "scale_channels": "from", "sam": "from",
              "yolo": "embedding_layer"}


def resized_shortcut_inputs(desc: ModelDesc) -> list[tuple[int, int, int, int]]:
    """(shortcut layer, from= layer, stride, sample) for each from= map whose size is not
    that of the map before its [shortcut] (shortcut_ratio's stride and sample)."""
    found = []
    for d in desc.layers:
        if d.kind != "shortcut":
            continue
        for src in d.inputs[1:]:
            stride, sample = shortcut_ratio(desc.layers[src].out_shape, d.in_shape)
            if (stride, sample) != (1, 1):
                found.append((d.index, src, stride, sample))
    return found


def with_explicit_subsampling(text: str, desc: ModelDesc, source: str = "<cfg>") -> str:
    """`text` (the .cfg of `desc`, its layers in the network's order) with a [route],
    [maxpool] pair before each [shortcut] for each from= map larger than the map before it,
    a [route] back, and every later layer index moved on. Text without such a [shortcut]
    comes back unchanged."""
    larger: dict[int, list[tuple[int, int]]] = {}
    for layer, src, stride, _ in resized_shortcut_inputs(desc):
        if stride > 1:
            larger.setdefault(layer, []).append((src, stride))
    if not larger:
        return text
    sections = parse_cfg(text, source)
    lines = text.splitlines()
    starts = [s.line - 1 for s in sections] + [len(lines)]  # 0-based header lines
    added = {i: 2 * len(srcs) + 1 for i, srcs in larger.items()}
    new, shift = [], 0  # new[i]: the index of old layer i in the written file
    for i in range(len(desc.layers)):
        shift += added.get(i, 0)
        new.append(i + shift)

    for i, sec in enumerate(sections[1:1 + len(desc.layers)]):
        key = REFERENCES.get(sec.name)
        if key is None or key not in sec.options:
            continue
        pools = {src: new[i] - added[i] + 2 * n + 1 for n, (src, _) in enumerate(larger.get(i, []))}
        try:
            refs = [int(v) for v in sec.options[key].split(",") if v.strip()]
        except ValueError:  # an embedding_layer= swarm does not read: left as it is
            continue
        moved = [_moved(ref, i, new, pools) for ref in refs]
        if moved != refs:
            _set_option(lines, starts[1 + i], starts[2 + i], key, ",".join(map(str, moved)))
    for i in range(len(desc.layers)):
        if new[i] != i:
            for n in _comment_block(lines, starts[1 + i]):
                if lines[n].strip()[1:].strip() == str(i):
                    lines[n] = f"{lines[n].strip()[0]} {new[i]}"
    for i in sorted(larger, reverse=True):  # bottom up: the lines above stay where they are
        top = min(_comment_block(lines, starts[1 + i]), default=starts[1 + i])
        lines[top:top] = _subsampling_layers(desc, i, larger[i], new) + [""]
    return "\n".join(lines) + "\n"


def _moved(ref: int, i: int, new: list[int], pools: dict[int, int]) -> int:
    """A layer index written in old layer `i`, for the file with the added layers: counted
    back stays counted back, from the start stays from the start. A from= map that is now
    subsampled is its [maxpool]; an index that is no earlier layer is left as darknet reads it."""
    src = i + ref if ref < 0 else ref
    if not 0 <= src < i:
        return ref
    to = pools.get(src, new[src])
    return to - new[i] if ref < 0 else to


def _subsampling_layers(desc: ModelDesc, i: int, srcs: list[tuple[int, int]], new: list[int]) -> list[str]:
    """The lines of the layers added before old layer `i`, a [shortcut], with a comment."""
    first = new[i] - 2 * len(srcs) - 1
    _, h, w = desc.layers[i].in_shape
    what = " and ".join(f"layer {new[src]}'s {desc.layers[src].out_shape[2]}x{desc.layers[src].out_shape[1]} map"
                        for src, _ in srcs)
    strides = " and ".join(str(k) for _, k in srcs)
    lines = [f"# {first}-{new[i] - 1}, added on export: {what} sampled with stride {strides} to {w}x{h} for the "
             "[shortcut] below:",
             "# darknet's shortcut_cpu subsamples a larger from= map itself; AlexeyAB's darknet and OpenCV's reader "
             "add maps of one size"]
    at = first
    for src, k in srcs:
        lines += ["[route]", f"layers={new[src] - at}", "[maxpool]", "size=1", f"stride={k}", "padding=0"]
        at += 2
    return lines + ["[route]", f"layers={new[i - 1] - at}"]


def _comment_block(lines: list[str], header: int) -> list[int]:
    """The comment lines right above the header line `header`, no blank line between."""
    block = []
    n = header - 1
    while n >= 0 and lines[n].strip()[:1] in ("#", ";"):
        block.append(n)
        n -= 1
    return block


def _set_option(lines: list[str], header: int, end: int, key: str, value: str) -> None:
    for n in range(header + 1, end):
        stripped = lines[n].split("#", 1)[0].split(";", 1)[0]
        if "=" in stripped and stripped.split("=", 1)[0].strip().lower() == key:
            lines[n] = f"{key}={value}"
            return
