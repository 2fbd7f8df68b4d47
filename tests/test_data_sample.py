"""`swarm data sample DIR`: a YOLO-format folder that swarm's own loader reads back whole."""
from __future__ import annotations

from PIL import Image

from swarm.data import open_datasets
from tests.conftest import run_swarm


def test_the_sample_is_a_yolo_folder_swarm_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_STATE_DIR", str(tmp_path / "state"))
    root = tmp_path / "sample"
    r = run_swarm("data", "sample", root, "--count", "20", "--width", "96", "--height", "64")
    assert r.returncode == 0, r.stderr
    assert f"swarm train --data {root}" in r.stdout
    assert (root / "classes.txt").read_text().split() == ["disc", "box", "triangle", "cross", "ring"]
    with Image.open(next((root / "train" / "images").iterdir())) as im:
        assert im.size == (96, 64) and im.format == "JPEG"
    train, held = open_datasets(str(root), 64, 3)
    assert (len(train), len(held), train.skipped, held.skipped) == (18, 2, [], [])
    assert train.classes[0] == "disc" and all(len(train.samples[k][1]) >= 1 for k in range(len(train)))
    again = run_swarm("data", "sample", root)
    assert again.returncode == 2 and "already exists" in again.stderr
