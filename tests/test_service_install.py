"""`swarm service install|uninstall --root`: the files, a second run with nothing to do, the user's mistakes,
and `swarm join` reading the config file it writes (flags and environment variables first)."""
from __future__ import annotations

import os
import stat
import sys
from argparse import Namespace

import pytest

from swarm.commands.join_cmd import agent_config
from swarm.errors import SwarmError
from swarm.host.config import JoinSettings, apply_settings, parse_settings, read_settings, render_settings
from swarm.service.unit import memory_limits, unit_text
from tests.conftest import run_swarm

TOKEN = "b3238c5af2a7521fd00b7e9827cf381978753eb45723f66a9196dbe8889d6953"        # strong tokens, fixed
OTHER_TOKEN = "4beadeaefeeb0fe39f98b64f0df63847addcde669cdf7e3ded910a082e96dd36"  # so that runs repeat


def install(root, *args):
    return run_swarm("service", "install", "--root", root, *args, timeout=60)


def test_install_writes_unit_config_token_and_user_then_has_nothing_to_do(tmp_path):
    root = tmp_path / "img"
    (tmp_path / "token").write_text(TOKEN + "\n")
    r = install(root, "--token-file", tmp_path / "token", "--port", "4751", "--name", "pi-3", "--gpu", "no")
    assert r.returncode == 0, r.stderr
    unit = root / "etc/systemd/system/swarm.service"
    for path in ("etc/systemd/system/swarm.service", "etc/swarm/swarm.toml", "etc/sysusers.d/swarm.conf",
                 "var/lib/swarm/token"):
        assert f"+ write {root / path}" in r.stdout or f"in {root / path}" in r.stdout, r.stdout
    assert (root / "var/lib/swarm/token").read_text() == TOKEN + "\n"
    assert stat.S_IMODE((root / "var/lib/swarm/token").stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "var/lib/swarm").stat().st_mode) == 0o700
    assert os.readlink(root / "etc/systemd/system/multi-user.target.wants/swarm.service") == \
        "/etc/systemd/system/swarm.service"
    assert (root / "etc/sysusers.d/swarm.conf").read_text().splitlines()[-1] == 'u swarm - "swarm agent" /var/lib/swarm'
    text = unit.read_text()
    assert "User=swarm\n" in text and "--config /etc/swarm/swarm.toml" in text
    assert f"ExecStart={sys.executable} -m swarm join" in text or f"ExecStart={os.path.dirname(sys.executable)}" in text
    assert not (root / "etc/systemd/system/swarm.service.d").exists()
    settings = read_settings(root / "etc/swarm/swarm.toml")
    assert settings == JoinSettings(port=4751, name="pi-3", token_file="/var/lib/swarm/token",
                                    state_dir="/var/lib/swarm", mdns=True)

    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*") if not p.is_symlink()}
    again = install(root, "--token-file", tmp_path / "token", "--gpu", "no")
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"nothing to do: swarm.service is installed and up to date under {root}\n"
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*") if not p.is_symlink()} == stamps


def test_reinstall_keeps_edited_settings_and_changes_only_what_differs(tmp_path):
    root = tmp_path / "img"
    assert install(root, "--gpu", "no").returncode == 0
    token = (root / "var/lib/swarm/token").read_text()               # the first device: a new token
    config = root / "etc/swarm/swarm.toml"
    config.write_text(config.read_text().replace('interface = ""', 'interface = "eth0"'))
    r = install(root, "--name", "jetson-1", "--user", "nobody", "--gpu", "yes")
    assert r.returncode == 0, r.stderr
    assert read_settings(config).interface == "eth0" and read_settings(config).name == "jetson-1"
    assert (root / "var/lib/swarm/token").read_text() == token      # kept
    assert "User=nobody\n" in (root / "etc/systemd/system/swarm.service").read_text()
    dropin = (root / "etc/systemd/system/swarm.service.d/gpu.conf").read_text()
    assert "PrivateDevices=no" in dropin
    assert "token" not in r.stdout
    (tmp_path / "other").write_text(OTHER_TOKEN)
    r = install(root, "--token-file", tmp_path / "other", "--user", "nobody", "--gpu", "no")
    assert f"+ replace the cluster token in {root}/var/lib/swarm/token" in r.stdout
    assert f"+ remove {root}/etc/systemd/system/swarm.service.d/gpu.conf" in r.stdout
    assert not (root / "etc/systemd/system/swarm.service.d").exists()


def test_dry_run_changes_nothing(tmp_path):
    r = install(tmp_path / "img", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"would write {tmp_path}/img/etc/systemd/system/swarm.service" in r.stdout
    assert not (tmp_path / "img").exists() or not any((tmp_path / "img").rglob("*"))


def test_a_jetson_gets_the_gpu_drop_in(tmp_path):
    root = tmp_path / "img"
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 3.0\n")
    (root / "etc/group").write_text("root:x:0:\nvideo:x:44:\nrender:x:110:\n")
    r = install(root)
    assert r.returncode == 0, r.stderr
    assert "GPU found (/etc/nv_tegra_release)" in r.stdout
    dropin = (root / "etc/systemd/system/swarm.service.d/gpu.conf").read_text()
    assert "PrivateDevices=no\nSupplementaryGroups=video render\n" in dropin


@pytest.mark.parametrize("args, words", [
    (["--user", "no-such-user-here"], "there is no user 'no-such-user-here'"),
    (["--token-file", "/nonexistent/token"], "token file /nonexistent/token does not exist"),
    (["--gpu", "maybe"], "invalid choice"),
    (["--memory", "lots"], "'lots' is not a size (e.g. 1G, 512M)"),
])
def test_user_mistakes_are_one_line(tmp_path, args, words):
    r = install(tmp_path / "img", *args)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "img").exists()


def test_a_weak_token_is_refused_until_a_strong_one_replaces_it(tmp_path):
    root = tmp_path / "img"
    (tmp_path / "weak").write_text("secret" * 6 + "\n")
    r = install(root, "--token-file", tmp_path / "weak")
    assert r.returncode == 2 and "Traceback" not in r.stderr and not root.exists()
    assert r.stderr.strip() == f"swarm service: error: the cluster token from {tmp_path}/weak is too easy to guess " \
                               f"(a 6-character piece repeated): make one with `swarm token --new` and give it to " \
                               f"every device of the cluster"
    (root / "var/lib/swarm").mkdir(parents=True)          # one installed before tokens were checked
    (root / "var/lib/swarm/token").write_text("secret" * 6 + "\n")
    r = install(root, "--gpu", "no")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"token from {root}/var/lib/swarm/token is too easy to guess" in r.stderr
    (tmp_path / "strong").write_text(TOKEN)
    r = install(root, "--gpu", "no", "--token-file", tmp_path / "strong")
    assert r.returncode == 0 and f"+ replace the cluster token in {root}/var/lib/swarm/token" in r.stdout, r.stderr
    assert (root / "var/lib/swarm/token").read_text() == TOKEN + "\n"


def test_without_root_it_asks_for_sudo(monkeypatch, capsys):
    from swarm.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["service", "install"]) == 2
    err = capsys.readouterr().err
    assert err == "swarm service: error: `swarm service install` changes /etc and /var/lib: run it as root " \
                  "(sudo swarm service install), or give --root DIR to write under DIR\n"


def test_broken_config_file_is_reported_not_overwritten(tmp_path):
    root = tmp_path / "img"
    (root / "etc/swarm").mkdir(parents=True)
    (root / "etc/swarm/swarm.toml").write_text("port = 'many'\n")
    r = install(root)
    assert r.returncode == 2 and "port must be a whole number 0-65535, got 'many'" in r.stderr
    assert (root / "etc/swarm/swarm.toml").read_text() == "port = 'many'\n"


def test_uninstall_keeps_token_and_config_unless_purged(tmp_path):
    root = tmp_path / "img"
    assert install(root, "--gpu", "yes").returncode == 0
    r = run_swarm("service", "uninstall", "--root", root)
    assert r.returncode == 0, r.stderr
    assert not (root / "etc/systemd/system/swarm.service").exists()
    assert not (root / "etc/systemd/system/swarm.service.d").exists()
    assert not (root / "etc/systemd/system/multi-user.target.wants/swarm.service").is_symlink()
    assert (root / "var/lib/swarm/token").exists() and "--purge removes them" in r.stdout
    r = run_swarm("service", "uninstall", "--root", root, "--purge")
    assert r.returncode == 0 and not (root / "var/lib/swarm").exists() and not (root / "etc/swarm").exists()
    r = run_swarm("service", "uninstall", "--root", root, "--purge")
    assert r.stdout == f"nothing to do: swarm.service is not installed under {root}\n"


# -- swarm join reads the file ------------------------------------------------------------

def join_args(**flags) -> Namespace:
    base = dict(port=None, name=None, state_dir=None, token_file=None, interface=None, peers=None, no_mdns=None,
                config=None, verbose=False, accelerator=None, reserve=None)
    return Namespace(**{**base, **flags})


def test_join_takes_its_settings_from_the_file_and_flags_win(tmp_path, monkeypatch):
    (tmp_path / "token").write_text(TOKEN)
    config = tmp_path / "swarm.toml"
    config.write_text(render_settings(JoinSettings(port=4799, interface="lo", name="from-file",
                                                   token_file=str(tmp_path / "token"),
                                                   state_dir=str(tmp_path / "state"), peers="10.0.0.9", mdns=False),
                                      "test"))
    monkeypatch.delenv("SWARM_INTERFACE")
    monkeypatch.setenv("SWARM_CONFIG", str(config))
    agent, state_dir, token_from = agent_config(join_args())
    assert (agent.port, agent.name, agent.network.interface, agent.advertise) == (4799, "from-file", "lo", False)
    assert agent.token == TOKEN and token_from == str(tmp_path / "token")
    assert state_dir == tmp_path / "state" and agent.peers == (("10.0.0.9", 4750),)

    agent, _, _ = agent_config(join_args(port=0, name="from-flag", no_mdns=None))
    assert (agent.port, agent.name) == (0, "from-flag")

    monkeypatch.setenv("SWARM_TOKEN", OTHER_TOKEN)       # an environment variable beats the file
    monkeypatch.setenv("SWARM_STATE_DIR", str(tmp_path / "env-state"))
    agent, state_dir, token_from = agent_config(join_args())
    assert agent.token == OTHER_TOKEN and token_from == "SWARM_TOKEN" and state_dir == tmp_path / "env-state"


def test_no_file_means_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_CONFIG", os.devnull)
    agent, state_dir, _ = agent_config(join_args(state_dir=str(tmp_path)))
    assert agent.port == 4750 and agent.advertise and agent.network.interface == "lo"


def test_settings_file_errors_name_the_file_and_the_setting(tmp_path):
    with pytest.raises(SwarmError, match=r"x.toml: unknown setting 'prot' \(known: port, interface"):
        parse_settings("prot = 1\n", "x.toml")
    with pytest.raises(SwarmError, match="x.toml is not valid TOML"):
        parse_settings("port = \n", "x.toml")
    with pytest.raises(SwarmError, match="mdns must be true or false"):
        parse_settings("mdns = 'yes'\n", "x.toml")
    with pytest.raises(SwarmError, match="config file .*missing.toml does not exist"):
        read_settings(tmp_path / "missing.toml")
    assert parse_settings('peers = ["a:1", "b"]\nname = ""\n', "x") == JoinSettings(peers="a:1,b")
    args = join_args(port=5000)
    apply_settings(args, JoinSettings(port=4000, interface="eth0"), environ={"SWARM_INTERFACE": "lo"})
    assert args.port == 5000 and args.interface is None


def test_join_with_a_missing_config_file_is_one_line(tmp_path):
    r = run_swarm("join", "--config", tmp_path / "nope.toml", "--state-dir", tmp_path, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"swarm join: error: config file {tmp_path}/nope.toml does not exist " \
                               f"(given by --config or SWARM_CONFIG)"


def test_unit_quotes_odd_paths():
    text = unit_text(["/opt/my swarm/bin/swarm"], "pi", memory=2**30)
    assert 'ExecStart="/opt/my swarm/bin/swarm" join --config /etc/swarm/swarm.toml\n' in text
    assert "ExecStart=/opt/50%%/swarm join" in unit_text(["/opt/50%/swarm"], memory=2**30)


def test_memory_limit_is_this_systems_unless_given(tmp_path):
    """A live install takes the memory from the system; an image needs --memory, or is told so."""
    r = install(tmp_path / "img", "--gpu", "no")
    assert r.returncode == 0, r.stderr
    assert "the unit's memory limit is made for this system's" in r.stdout and "--memory SIZE" in r.stdout
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    unit = (tmp_path / "img/etc/systemd/system/swarm.service").read_text()
    assert f"MemoryMax={memory_limits(total)[1] >> 20}M\n" in unit
    r = install(tmp_path / "img", "--gpu", "no", "--memory", "2G")
    assert r.returncode == 0 and "memory limit is made" not in r.stdout, r.stdout
    assert f"+ write {tmp_path}/img/etc/systemd/system/swarm.service" in r.stdout
    unit = (tmp_path / "img/etc/systemd/system/swarm.service").read_text()
    assert "MemoryHigh=1680M\nMemoryMax=1792M\n" in unit and "2.0 GiB of memory" in unit


def test_state_directory_is_handed_to_the_service_user(tmp_path):
    """Files root left there (a token just written, an earlier `sudo swarm join`) become the user's."""
    from swarm.commands.service_cmd import ownership_step

    state = tmp_path / "state"
    (state / "profiles").mkdir(parents=True)
    (state / "node_id").write_text("abc\n")
    steps = []
    ownership_step(steps, state, "nobody", pending=False)
    assert [s.what for s in steps] == [f"hand {state} to user nobody"]
    if os.geteuid() != 0:
        pytest.skip("changing owners needs root")
    steps[0].take()
    import pwd
    assert {p.stat().st_uid for p in [state, *state.rglob("*")]} == {pwd.getpwnam("nobody").pw_uid}
    steps = []
    ownership_step(steps, state, "nobody", pending=False)
    assert steps == []
    ownership_step(steps, state, "nobody", pending=True)   # a token is about to be written there
    assert len(steps) == 1
