"""deploy/install.sh under a temporary root: a dry run changes nothing, a real run makes the virtual
environment, installs the package and the service, and a second run has nothing to do."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "deploy" / "install.sh"


def run_script(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """This source tree as a wheel, built offline from a copy (the working tree stays clean)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    source.mkdir()
    for name in ("swarm", "tiles", "planner"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp / "dist"), str(source)]
    # offline with this environment's setuptools (>= 70.1, or the wheel package), else pip fetches a build backend
    r = subprocess.run(build + ["--no-build-isolation", "--no-index"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        r = subprocess.run(build, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.skip(f"cannot build a wheel of swarm here: {r.stderr.strip().splitlines()[-1:]}")
    return next((tmp / "dist").glob("swarm_train-*.whl"))


def test_dry_run_says_what_it_would_do_and_does_nothing(tmp_path):
    root = tmp_path / "img"
    r = run_script("--root", root, "--dry-run", "--from", ROOT)
    assert r.returncode == 0, r.stderr
    assert f"would create the virtual environment {root}/opt/swarm/venv" in r.stdout
    assert f"would install swarm from {ROOT} into {root}/opt/swarm/venv" in r.stdout
    assert f"would run: swarm service install --root {root}" in r.stdout
    assert "steps to take, nothing changed" in r.stdout
    assert not root.exists()


def test_mistakes_are_one_line(tmp_path):
    r = run_script("--root", tmp_path, "--token-file", tmp_path / "none")
    assert r.returncode == 2 and r.stderr == f"install.sh: error: token file {tmp_path}/none does not exist\n"
    r = run_script("--frm", "x")
    assert r.returncode == 2 and "unknown option --frm" in r.stderr


def test_second_run_changes_nothing(tmp_path, wheel):
    root = tmp_path / "img"
    token = tmp_path / "token"
    token.write_text("7712d511db1a82705c3b17f405b29ba83b974bea9907301c94c139f70271552e\n")
    # The test stands in for the package index: the new environment sees this one's packages (trio,
    # msgpack, ...) through a .pth file, and pip installs only swarm itself, offline.
    site = root / "opt/swarm/venv" / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    site.mkdir(parents=True)
    (site / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    args = ["--root", root, "--from", wheel, "--pip-args", "--no-deps --no-index", "--token-file", token,
            "--gpu", "no"]

    first = run_script(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    for step in [f"+ create the virtual environment {root}/opt/swarm/venv",
                 f"+ install swarm from {wheel} into {root}/opt/swarm/venv",
                 f"+ link {root}/usr/local/bin/swarm -> /opt/swarm/venv/bin/swarm",
                 f"+ write {root}/etc/systemd/system/swarm.service",
                 f"+ install the cluster token in {root}/var/lib/swarm/token"]:
        assert step in first.stdout, first.stdout
    unit = (root / "etc/systemd/system/swarm.service").read_text()
    assert "ExecStart=/opt/swarm/venv/bin/swarm join --config /etc/swarm/swarm.toml\n" in unit
    assert (root / "var/lib/swarm/token").read_text() == token.read_text()
    installed = subprocess.run([str(root / "opt/swarm/venv/bin/python"), "-c", "import swarm; print(swarm.__file__)"],
                               capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, cwd=tmp_path)
    assert installed.stdout.startswith(str(root / "opt/swarm/venv")), installed

    files = {p: p.stat().st_mtime_ns for p in root.rglob("*") if not p.is_symlink()}
    second = run_script(*args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.splitlines()[-1] == f"nothing to do: swarm is installed and up to date under {root}"
    assert not [line for line in second.stdout.splitlines() if line.startswith(("+", "would"))], second.stdout
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if not p.is_symlink()} == files
