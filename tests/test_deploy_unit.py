"""The systemd unit: what deploy/ holds is what `swarm service install` writes, its resource limits follow
the device's memory, `systemd-analyze verify` accepts it, and `systemd-analyze security --offline=true`
rates its exposure 3.0 or lower, GPU drop-in too, the same with the resource limits as without."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from swarm.commands.service_cmd import CONFIG_HEADER
from swarm.host.config import JoinSettings, render_settings
from swarm.service import unit as su
from tests.conftest import ROOT, run_swarm

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")
MAX_EXPOSURE = 3.0
MiB, GiB = su.MiB, su.GiB
LIMIT_SETTINGS = ("MemoryHigh=", "MemoryMax=", "LimitNOFILE=", "TasksMax=")


def test_deploy_files_are_what_install_writes():
    deploy = ROOT / "deploy"
    assert (deploy / "swarm.service").read_text() == su.unit_text(memory=su.REFERENCE_MEMORY)
    assert (deploy / "gpu.conf").read_text() == su.gpu_dropin_text(su.GPU_GROUPS)
    assert (deploy / "sysusers-swarm.conf").read_text() == su.sysusers_text()
    assert (deploy / "swarm.toml").read_text() == render_settings(
        JoinSettings(port=4750, token_file="/var/lib/swarm/token", state_dir="/var/lib/swarm", mdns=True),
        CONFIG_HEADER)


def test_unit_asks_for_what_the_service_needs():
    lines = set(su.unit_text(memory=su.REFERENCE_MEMORY).splitlines())
    for line in ["Type=notify", "WatchdogSec=30s", "Restart=on-failure", "StartLimitBurst=20",
                 "After=network-online.target", "Wants=network-online.target", "StateDirectory=swarm",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK", "WantedBy=multi-user.target",
                 "LimitNOFILE=16384", "TasksMax=512"]:
        assert line in lines, line


def limits(text: str) -> dict[str, str]:
    """The unit's resource-limit settings, e.g. {'MemoryMax': '768M', ...}."""
    return dict(line.split("=", 1) for line in text.splitlines() if line.startswith(LIMIT_SETTINGS))


@pytest.mark.parametrize("memory, high, most", [
    (1 * GiB, "720M", "768M"),          # a 1 GiB Raspberry Pi: the system keeps 256 MiB
    (906 * MiB, "600M", "640M"),        # what a Pi 3 reports as MemTotal (the GPU has its share)
    (8 * GiB, "6720M", "7168M"),        # an 8 GiB Jetson: the system keeps 1/8, 1 GiB
    (7620 * MiB, "6240M", "6656M"),     # what a Jetson Orin Nano 8 GB reports
])
def test_memory_limits_follow_the_devices_memory(memory, high, most):
    assert limits(su.unit_text(memory=memory)) == {"MemoryHigh": high, "MemoryMax": most, "LimitNOFILE": "16384",
                                                   "TasksMax": "512"}


@pytest.mark.parametrize("memory", [400 * MiB, 906 * MiB, 1 * GiB, 2 * GiB, 4 * GiB, 7620 * MiB, 64 * GiB])
def test_memory_rule(memory):
    """MemoryMax = total - max(256 MiB, total/8), at least half, rounded down to 16 MiB; MemoryHigh 1/16 below."""
    high, most = su.memory_limits(memory)
    reserve = max(256 * MiB, memory // 8)
    assert most % (16 * MiB) == 0 and high == most - most // 16
    assert memory - reserve - 16 * MiB < most <= memory - reserve or memory // 2 - 16 * MiB < most <= memory // 2


# The unit as `swarm service install` writes it for a 1 GiB Raspberry Pi, and for an 8 GiB Jetson
# with the GPU drop-in.
DEVICES = {"no": "1G", "yes": "8G"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The unit as `swarm service install` writes it, with and without the GPU drop-in."""
    roots = {}
    for gpu, memory in DEVICES.items():
        root = tmp_path_factory.mktemp(f"gpu-{gpu}")
        r = run_swarm("service", "install", "--root", root, "--gpu", gpu, "--memory", memory, timeout=60)
        assert r.returncode == 0, r.stderr
        roots[gpu] = root / "etc/systemd/system/swarm.service"
    return roots


def test_install_makes_the_limits_for_the_memory_given(installed):
    assert limits(installed["no"].read_text())["MemoryMax"] == "768M"
    assert limits(installed["yes"].read_text())["MemoryMax"] == "7168M"


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


@needs_analyze
def test_resource_limits_leave_the_exposure_as_it_was(installed, tmp_path):
    """The limits are not hardening systemd-analyze rates: the unit without them scores the same."""
    text = installed["no"].read_text()
    bare = tmp_path / "swarm.service"
    bare.write_text("".join(line for line in text.splitlines(True) if not line.startswith(LIMIT_SETTINGS)))
    assert len(limits(text)) == 4 and not limits(bare.read_text())
    assert exposure(installed["no"]) == exposure(bare)
