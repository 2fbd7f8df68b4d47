"""jemalloc where it is not installed: Debian's package fetched and unpacked by the `swarm`
command (swarm.host.malloc.fetch_jemalloc), here from a fake apt-get on PATH; and, where
dpkg-deb and a jemalloc library are here, a package built from that library, unpacked by the
real dpkg-deb and preloaded by a command that trains."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.host import malloc
from tests.conftest import jemalloc_library

ROOT = Path(__file__).resolve().parent.parent

FAKE_APT = """#!/bin/sh
echo "$@" >> "{log}"
[ -n "{fail}" ] && exit 100
cp "{deb}" ./libjemalloc2_5.3.0-1_test.deb
"""
FAKE_UNPACK = """#!/bin/sh
# dpkg-deb -x DEB DIR: the library where Debian puts it, and its usual link
mkdir -p "$3/usr/lib/triplet" && cp "{library}" "$3/usr/lib/triplet/libjemalloc.so.2.real"
ln -s libjemalloc.so.2.real "$3/usr/lib/triplet/libjemalloc.so.2"
"""


def _tools(tmp_path: Path, monkeypatch, fail: bool = False, unpack: bool = True) -> Path:
    """A fake apt-get (and dpkg-deb) first on PATH; the file of apt-get's calls."""
    bin_dir, log = tmp_path / "bin", tmp_path / "apt-calls"
    bin_dir.mkdir(exist_ok=True)
    deb, library = tmp_path / "package.deb", tmp_path / "library"
    deb.write_bytes(b"a package")
    library.write_bytes(b"\x7fELF a library")
    (bin_dir / "apt-get").write_text(FAKE_APT.format(log=log, fail="yes" if fail else "", deb=deb))
    if unpack:
        (bin_dir / "dpkg-deb").write_text(FAKE_UNPACK.format(library=library))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def _calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def folders(tmp_path, monkeypatch):
    found = [tmp_path / "install" / "swarm-jemalloc", tmp_path / "cache" / "jemalloc"]
    monkeypatch.setattr(malloc, "fetched_dirs", lambda: found)
    monkeypatch.delenv(malloc.FETCH, raising=False)
    return found


def test_it_fetches_once_into_the_install_and_says_so(tmp_path, monkeypatch, folders, capsys):
    log = _tools(tmp_path, monkeypatch)
    assert malloc.fetched_jemalloc() is None
    path = malloc.fetch_jemalloc()
    assert path == str(folders[0] / "libjemalloc.so.2")
    assert Path(path).read_bytes() == b"\x7fELF a library" and not Path(path).is_symlink()
    assert (folders[0] / "SOURCE").read_text() == "libjemalloc2_5.3.0-1_test.deb\n"
    assert sorted(p.name for p in folders[0].iterdir() if not p.name.startswith(".")) == ["SOURCE", "libjemalloc.so.2"]
    err = capsys.readouterr().err
    assert "fetched Debian's libjemalloc2_5.3.0-1_test.deb" in err and "SWARM_MALLOC=glibc" in err
    assert _calls(log) == 1 and "download" in log.read_text()
    # from now on it is found, not fetched again
    assert malloc.fetched_jemalloc() == path
    monkeypatch.setattr(malloc, "find_jemalloc", lambda: None)  # as on a system without it installed
    assert malloc.jemalloc_library({}, fetch=True) == path
    assert malloc.fetch_jemalloc() == path and _calls(log) == 1


def test_a_failed_fetch_is_said_in_a_line_and_not_tried_again_for_a_day(tmp_path, monkeypatch, folders, capsys):
    log = _tools(tmp_path, monkeypatch, fail=True)
    assert malloc.fetch_jemalloc() is None
    err = capsys.readouterr().err.strip()
    assert err.startswith("swarm: could not fetch jemalloc") and "\n" not in err
    assert malloc.fetch_jemalloc() is None and _calls(log) == 1
    marker = folders[0] / "failed"
    day_ago = time.time() - malloc.FETCH_RETRY_S - 60
    os.utime(marker, (day_ago, day_ago))
    assert malloc.fetch_jemalloc() is None and _calls(log) == 2
    assert not list(folders[0].glob("libjemalloc*")) and not list(folders[0].glob("tmp*"))


def test_where_the_install_cannot_be_written_it_goes_to_the_cache(tmp_path, monkeypatch, folders):
    _tools(tmp_path, monkeypatch)
    folders[0].parent.parent.mkdir(parents=True, exist_ok=True)
    folders[0].parent.write_text("a file where the folder would be")
    assert malloc.fetch_jemalloc() == str(folders[1] / "libjemalloc.so.2")


def test_without_apt_nothing_is_fetched_or_written(tmp_path, monkeypatch, folders):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert malloc.fetch_jemalloc() is None
    assert not any(f.exists() for f in folders)


def test_a_package_without_the_library_is_a_failed_fetch(tmp_path, monkeypatch, folders):
    _tools(tmp_path, monkeypatch, unpack=False)
    bin_dir = tmp_path / "bin"
    (bin_dir / "dpkg-deb").write_text("#!/bin/sh\nmkdir -p \"$3/usr/share/doc\"\n")
    (bin_dir / "dpkg-deb").chmod(0o755)
    assert malloc.fetch_jemalloc() is None and (folders[0] / "failed").exists()


def test_the_environment_decides_whether_a_fetched_one_is_used(tmp_path, monkeypatch, folders):
    _tools(tmp_path, monkeypatch)
    path = malloc.fetch_jemalloc()
    monkeypatch.setattr(malloc, "find_jemalloc", lambda: None)  # as on a system without it installed
    assert malloc.jemalloc_library({}) == path
    for env in ({malloc.FETCH: "0"}, {"SWARM_MALLOC": "glibc"}, {"LD_PRELOAD": "/opt/libtcmalloc.so"},
                {"MALLOC_ARENA_MAX": "2"}):
        assert malloc.jemalloc_library(env, fetch=True) is None, env
    # and a command started on it runs on it, as on an installed one
    assert malloc.preload_environment({"PATH": "/usr/bin"}, malloc.jemalloc_library({}), glibc=True) == {
        "PATH": "/usr/bin", "LD_PRELOAD": path, "MALLOC_CONF": malloc.JEMALLOC_CONF, malloc.PRELOADED: path}


def test_processes_starting_together_fetch_once(tmp_path, monkeypatch, folders):
    log = _tools(tmp_path, monkeypatch)
    code = ("import sys; from pathlib import Path; from swarm.host import malloc; "
            f"malloc.fetched_dirs = lambda: [Path({str(folders[0])!r})]; print(malloc.fetch_jemalloc())")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == [str(folders[0] / "libjemalloc.so.2")] * 3
    assert _calls(log) == 1


@pytest.mark.skipif(shutil.which("dpkg-deb") is None or jemalloc_library() is None,
                    reason="jemalloc is not installed here (or no dpkg-deb to unpack it)")
def test_a_command_that_trains_fetches_a_real_package_and_runs_on_it(tmp_path):
    """A real package (built here from the jemalloc library the allocator tests use), unpacked
    by the real dpkg-deb, preloaded by `preload` as the `swarm` command does before it trains."""
    package = tmp_path / "pkg"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "DEBIAN" / "control").write_text(
        "Package: libjemalloc2\nVersion: 5.3.0-1\nArchitecture: all\nMaintainer: swarm tests <tests@localhost>\n"
        "Description: jemalloc, repackaged for a test\n")
    (package / "usr" / "lib" / "triplet").mkdir(parents=True)
    shutil.copyfile(jemalloc_library(), package / "usr" / "lib" / "triplet" / "libjemalloc.so.2")
    deb = tmp_path / "built.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(package), str(deb)], check=True,
                   capture_output=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(f"#!/bin/sh\ncp {deb} ./libjemalloc2_5.3.0-1_all.deb\n")
    (bin_dir / "apt-get").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "SWARM_MALLOC", "GLIBC_TUNABLES",
                                                        malloc.FETCH, malloc.PRELOADED)}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT),
               SWARM_JEMALLOC_DIR=str(tmp_path / "fetched"))
    code = ("import sys; from swarm.host import malloc; malloc.find_jemalloc = lambda: None; "
            "malloc.preload(['train']); print(malloc.allocator(), malloc.fetched_jemalloc())")
    for attempt in range(2):  # fetched, then found
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["jemalloc", str(tmp_path / "fetched" / "libjemalloc.so.2")], out
        assert ("fetched Debian's libjemalloc2_5.3.0-1_all.deb" in out.stderr) == (attempt == 0)
    assert (tmp_path / "fetched" / "SOURCE").read_text() == "libjemalloc2_5.3.0-1_all.deb\n"


def test_without_a_home_the_install_is_the_one_place(monkeypatch):
    monkeypatch.delenv("SWARM_JEMALLOC_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert malloc.fetched_dirs() == [Path(sys.prefix) / "lib" / "swarm-jemalloc"]


def test_a_failure_while_looking_for_jemalloc_leaves_the_command_as_it_is(monkeypatch):
    def broken(*args, **kwargs):
        raise PermissionError("a folder it may not read")

    started = []
    monkeypatch.setattr(malloc, "jemalloc_library", broken)
    monkeypatch.setattr(malloc, "find_jemalloc", lambda: None)
    monkeypatch.setattr(malloc.os, "execve", lambda *a: started.append(a))
    monkeypatch.setenv(malloc.PRELOADED, "glibc")  # started again already: nothing to change
    malloc.preload(["train"])
    assert started == []
