"""The systemd unit: what deploy/ holds is what `swarm service install` writes, `systemd-analyze verify`
accepts it, and `systemd-analyze security --offline=true` rates its exposure 3.0 or lower, GPU drop-in too."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from swarm import service_unit as su
from swarm.commands.service_cmd import CONFIG_HEADER
from swarm.config import JoinSettings, render_settings
from tests.conftest import ROOT, run_swarm

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")
MAX_EXPOSURE = 3.0


def test_deploy_files_are_what_install_writes():
    deploy = ROOT / "deploy"
    assert (deploy / "swarm.service").read_text() == su.unit_text()
    assert (deploy / "gpu.conf").read_text() == su.gpu_dropin_text(su.GPU_GROUPS)
    assert (deploy / "sysusers-swarm.conf").read_text() == su.sysusers_text()
    assert (deploy / "swarm.toml").read_text() == render_settings(
        JoinSettings(port=4750, token_file="/var/lib/swarm/token", state_dir="/var/lib/swarm", mdns=True),
        CONFIG_HEADER)


def test_unit_asks_for_what_the_service_needs():
    lines = set(su.unit_text().splitlines())
    for line in ["Type=notify", "WatchdogSec=30s", "Restart=on-failure", "StartLimitBurst=20",
                 "After=network-online.target", "Wants=network-online.target", "StateDirectory=swarm",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK", "WantedBy=multi-user.target"]:
        assert line in lines, line


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The unit as `swarm service install` writes it, with and without the GPU drop-in."""
    roots = {}
    for gpu in ("no", "yes"):
        root = tmp_path_factory.mktemp(f"gpu-{gpu}")
        r = run_swarm("service", "install", "--root", root, "--gpu", gpu, timeout=60)
        assert r.returncode == 0, r.stderr
        roots[gpu] = root / "etc/systemd/system/swarm.service"
    return roots


@needs_analyze
@pytest.mark.parametrize("gpu", ["no", "yes"])
def test_systemd_analyze_verify_accepts_the_unit(installed, gpu):
    r = subprocess.run([ANALYZE, "verify", str(installed[gpu])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "swarm.service" not in r.stderr and "gpu.conf" not in r.stderr, r.stderr   # not even a warning


def exposure(unit) -> float:
    r = subprocess.run([ANALYZE, "security", "--offline=true", str(unit)], capture_output=True, text=True,
                       timeout=60)
    found = re.search(r"Overall exposure level for swarm\.service: (\d+\.\d)", r.stdout)
    assert found, r.stdout + r.stderr
    return float(found.group(1))


@needs_analyze
def test_security_exposure_is_at_most_3(installed):
    base, gpu = exposure(installed["no"]), exposure(installed["yes"])
    assert base <= MAX_EXPOSURE and gpu <= MAX_EXPOSURE, (base, gpu)
    assert base < gpu   # the drop-in really is read: it opens the device nodes
    print(f"exposure: {base} (unit), {gpu} (with the GPU drop-in)")
