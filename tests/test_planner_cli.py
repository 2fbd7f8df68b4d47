"""`swarm plan` and `swarm profile` as a user meets them: tables, pictures, plan files, mistakes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.plan import Plan
from tests.conftest import run_swarm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def plan(*args, tmp_path, env=None):
    """`swarm plan` at 416 (the papers' size) unless the arguments give a size."""
    size = [] if "--img-size" in args or "--model" not in args else ["--img-size", "416"]
    return run_swarm("plan", *size, *args, cwd=tmp_path,
                     env={"SWARM_STATE_DIR": str(tmp_path / "state"), **(env or {})})


def test_plan_plans_at_the_size_train_trains_at(tmp_path):
    """No --img-size: the size swarm train would train at (128 for yolov2-16), not the .cfg's 416."""
    r = run_swarm("plan", "--model", "yolov2-16", "--devices", EXAMPLES / "rama-pi-cluster.json", "--strategy", "dp",
                  cwd=tmp_path, env={"SWARM_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    assert "yolov2-16 at 128x128" in r.stdout


def test_plan_a_described_cluster_with_picture_and_plan_file(tmp_path):
    r = plan("--model", "yolov2-16", "--devices", EXAMPLES / "pi-jetson-cluster.json", "--microbatches", "4",
             "--strategy", "asteroid", "--accelerators", "off", "--out", "p.json", "--show", "p.png", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "planner asteroid" in r.stdout and "predicted step" in r.stdout
    for device in ("pi-data", "jetson-1"):
        assert device in r.stdout
    saved = Plan.from_json((tmp_path / "p.json").read_text())
    assert saved.planner == "asteroid" and saved.predicted["fits"]
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_compare_lists_every_planner(tmp_path):
    r = plan("--model", "yolov2-16", "--devices", EXAMPLES / "rama-pi-cluster.json", "--batch-size", "8",
             "--microbatches", "2", "--compare", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for name in ("local", "dp", "pp", "tiles", "jointdnn", "hiertrain", "asteroid", "auto"):
        assert any(line.startswith(name + " ") for line in lines), name
    assert "NO" in r.stdout  # a Pi alone cannot hold yolov2-16 at 416


def test_planning_a_described_cluster_loads_neither_torch_nor_the_agent(tmp_path):
    """`swarm plan --devices FILE` is arithmetic on the model's description and the file: it
    answers without torch or the agent's code (seconds to import on a small device), and the
    command line's help names the agent's port without importing the agent either."""
    import subprocess
    import sys

    probe = ("import sys\nfrom swarm.cli import build_parser, main\nbuild_parser()\n"
             "print(sorted(m for m in ('torch', 'swarm.agent', 'trio') if m in sys.modules))\n"
             "print(main(sys.argv[1:]))\nprint('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", probe, "plan", "--model", "yolov2-16", "--img-size", "416", "--devices",
                        str(EXAMPLES / "rama-pi-cluster.json"), "--strategy", "dp", "--microbatches", "4"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "SWARM_STATE_DIR": str(tmp_path / "state")})
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "[]", r.stdout  # the parser alone
    assert lines[-2:] == ["0", "False"], (r.stdout, r.stderr)  # planned, and torch never loaded
    assert "planner dp" in r.stdout and "predicted step" in r.stdout, r.stdout


def test_a_plan_that_does_not_fit_says_where_and_by_how_much(tmp_path):
    r = plan("--model", "yolov2-16", "--img-size", "416", "--microbatches", "2", "--devices",
             EXAMPLES / "rama-pi-cluster.json", "--strategy", "local", "--out", "p.json", tmp_path=tmp_path)
    assert r.returncode == 2
    assert "does not fit: stage 0 needs" in r.stderr and "on device pi-1, which has 856 MiB" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--strategy", "fastest"], "unknown --strategy 'fastest'"),
    (["--devices", "missing.json"], "cannot read missing.json"),
    (["--model", "nonet"], "unknown model 'nonet'"),
    (["--compare", "--strategy", "dp"], "--compare runs every strategy"),
])
def test_mistakes_are_plain_messages(tmp_path, args, message):
    r = plan(*args, tmp_path=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_bad_cluster_file_names_the_problem(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"devices": [{"name": "a", "memory": "1 GiB"}]}))
    r = plan("--devices", "c.json", tmp_path=tmp_path)
    assert r.returncode == 2 and "c.json: device a: give exactly one of" in r.stderr


def test_profile_then_plan_this_machine_from_the_cache(tmp_path):
    r = run_swarm("profile", "--model", "yolov2-16", "--img-size", "32", "--batch-sizes", "1,2", "--repeats", "1",
                  "--threads", "1", "--out", "me.json", cwd=tmp_path, env={"SWARM_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    assert "whole step (measured)" in r.stdout and "cached in" in r.stdout
    assert json.loads((tmp_path / "me.json").read_text())["kind"] == "swarm-profile"
    r = plan("--model", "yolov2-16", "--img-size", "32", "--threads", "1", "--json", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "using the cached profile" in r.stderr and "--devices CLUSTER.json" in r.stderr
    assert Plan.from_json(r.stdout).stages[0].mode == "single"
    # the profile describes this device in a cluster file too
    (tmp_path / "c.json").write_text(json.dumps({"bandwidth_mbps": 100, "devices": [
        {"name": "me", "memory": "2 GiB", "profile": "me.json"},
        {"name": "twin", "memory": "2 GiB", "profile": "me.json"}]}))
    r = plan("--model", "yolov2-16", "--img-size", "32", "--devices", "c.json", "--microbatches", "2",
             "--strategy", "dp", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr and "twin" in r.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
def test_profile_on_cuda_without_a_gpu_is_one_line(tmp_path):
    r = run_swarm("profile", "--model", "lenet5", "--accelerator", "cuda", env={"SWARM_STATE_DIR": str(tmp_path)})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "torch sees no CUDA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_plan_on_the_live_swarm_plans_on_estimates_when_no_device_can_profile_the_model(tmp_path, monkeypatch):
    """Devices that cannot hold the whole model to measure it: `swarm plan` says so and plans
    on estimates from what the devices report (cores, memory), within their memory."""
    import argparse

    import swarm.profiling.survey as survey
    from swarm.commands import plan_cmd
    from swarm.zoo import describe_model

    from swarm.host.state import new_token

    (tmp_path / "token").write_text(new_token() + "\n")
    found = [{"name": f"dev{i}", "node_id": f"n{i}", "cores": 1, "memory": 2**30} for i in range(8)]

    async def gather_live(*args, **kwargs):
        return {"devices": found, "profiles": None, "links": {},
                "why": "job profile-1 on dev0 failed: this device cannot profile the model: ..."}

    monkeypatch.setattr(survey, "gather_live", gather_live)
    said = []
    monkeypatch.setattr(plan_cmd, "say", said.append)
    args = argparse.Namespace(state_dir=str(tmp_path), token_file=str(tmp_path / "token"), interface="lo", peers=None,
                              model="yolov2", threads=None, wait=0.0, accelerators="on")
    desc = describe_model("yolov2", 416)
    cluster, measured, why = plan_cmd.live_cluster(args, desc, None)
    assert measured is None and why is None
    assert [d.name for d in cluster.devices] == [d["name"] for d in found]
    assert all(0 < d.memory < 2**30 for d in cluster.devices)
    assert any("planning on estimates" in line for line in said), said
