"""`swarm service install|uninstall`: run `swarm join` at boot as a hardened systemd service.

install writes the unit (+ a GPU drop-in where there is a GPU), /etc/swarm/swarm.toml, the
cluster token in /var/lib/swarm and the service user's sysusers line, then reloads, enables
and starts (or restarts) the service. Each step is taken only when something differs, so a
second run reports nothing to do. --root DIR writes the same files under DIR and touches
nothing of the running system; --dry-run prints the steps without taking them.
"""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from swarm.commands.flags import port_number
from swarm.errors import SwarmError

CONFIG_HEADER = """\
Settings of `swarm join`, which the swarm service runs (written by `swarm service install`,
which keeps your values). Flags and SWARM_* environment variables override them.
After a change: sudo systemctl restart swarm"""

GPU_SIGNS = ("/etc/nv_tegra_release", "/dev/nvhost-ctrl-gpu", "/dev/nvmap", "/dev/nvidiactl")
HIDDEN_FROM_SERVICE = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")  # ProtectHome=, PrivateTmp=


def add_parser(sub) -> None:
    from swarm.commands.testbed_cmd import memory_size

    p = sub.add_parser("service", help="run the agent at boot as a systemd service (install, uninstall)",
                       description="Install or remove the swarm systemd service, which runs `swarm join` at boot, "
                                   "restarts it when it fails and locks it down. See docs/deploy.md.")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    i = actions.add_parser("install", help="install, enable and start the service (safe to repeat)", description=(
        "Write the unit, /etc/swarm/swarm.toml and the cluster token, create the service user, and "
        "enable and start the service when systemd is running. Repeating it changes only what differs."))
    i.add_argument("--user", help="existing account to run the agent as (default: a 'swarm' system user, "
                                  "created with systemd-sysusers)")
    i.add_argument("--token-file", metavar="FILE",
                   help="cluster token to use (from `swarm token` on the first device); default: keep the "
                        "installed one, or create a new one on the first device")
    i.add_argument("--port", type=port_number, help="port to listen on (written to the config file; default 4750)")
    i.add_argument("--interface", metavar="NAME|ADDRESS", help="network for discovery and connections "
                                                               "(written to the config file)")
    i.add_argument("--name", help="name shown by `swarm status` (written to the config file)")
    i.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                   help="give the agent the GPU's device nodes (default: auto, where a Jetson or NVIDIA GPU is found)")
    i.add_argument("--memory", metavar="SIZE", type=memory_size,
                   help="the device's memory (e.g. 1G, 8G), from which the unit's MemoryMax is computed "
                        "(default: this system's; give it with --root for an image of another device)")
    _add_common(i)
    u = actions.add_parser("uninstall", help="stop, disable and remove the service", description=(
        "Stop and disable the service and remove its unit. The config file and the state directory "
        "(token, node id, checkpoints) stay unless --purge."))
    u.add_argument("--purge", action="store_true", help="also remove /etc/swarm/swarm.toml, the sysusers line "
                                                        "and /var/lib/swarm (token, node id, checkpoints)")
    _add_common(u)
    p.set_defaults(run=run)


def _add_common(p) -> None:
    p.add_argument("--root", metavar="DIR", help="write under DIR instead of / (an image, a test): no systemctl, "
                                                 "no user creation, nothing of the running system changes")
    p.add_argument("--dry-run", action="store_true", help="print the steps without taking them")


@dataclass
class Step:
    """One change to the system: said in the imperative, taken by `take`."""
    what: str
    take: Callable[[], None]


class Target:
    """The system the files go to: / itself, or another root directory."""

    def __init__(self, root: str | None):
        self.root = Path(root).resolve() if root else None

    @property
    def live(self) -> bool:
        return self.root is None

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/") if self.root else Path(absolute)

    def inside(self, path: str) -> str:
        """`path` as the target system sees it (the root prefix taken off)."""
        if self.root is not None and Path(path).is_relative_to(self.root):
            return "/" + str(Path(path).relative_to(self.root))
        return path

    def systemd_running(self) -> bool:
        return self.live and Path("/run/systemd/system").is_dir()

    def _db_names(self, name: str) -> set[str] | None:
        """Names in ROOT/etc/passwd or ROOT/etc/group, or None to ask this system."""
        if self.root is None or not self.path(f"/etc/{name}").is_file():
            return None
        return {line.split(":", 1)[0] for line in self.path(f"/etc/{name}").read_text().splitlines() if ":" in line}

    def user_exists(self, user: str) -> bool:
        names = self._db_names("passwd")
        if names is not None:
            return user in names
        try:
            pwd.getpwnam(user)
        except KeyError:
            return False
        return True

    def group_exists(self, group: str) -> bool:
        names = self._db_names("group")
        if names is not None:
            return group in names
        try:
            grp.getgrnam(group)
        except KeyError:
            return False
        return True


def run(args) -> int:
    target = Target(args.root)
    if target.live and not args.dry_run and os.geteuid() != 0:
        raise SwarmError(f"`swarm service {args.action}` changes /etc and /var/lib: run it as root "
                         f"(sudo swarm service {args.action}), or give --root DIR to write under DIR")
    steps, notes = (install_steps if args.action == "install" else uninstall_steps)(args, target)
    where = f" under {target.root}" if target.root else ""
    if not steps:
        state = "installed and up to date" if args.action == "install" else "not installed"
        print(f"nothing to do: swarm.service is {state}{where}")
        return 0
    for step in steps:
        if args.dry_run:
            print(f"would {step.what}")
        else:
            print(f"+ {step.what}", flush=True)
            step.take()
    if not args.dry_run:
        for note in notes:
            print(note)
    return 0


# -- install ----------------------------------------------------------------------------

def install_steps(args, target: Target) -> tuple[list[Step], list[str]]:
    from swarm.ports import DEFAULT_PORT
    from swarm.host.config import JoinSettings, merged, read_settings, render_settings
    from swarm.host.state import read_token_file
    from swarm.service import unit as su

    user = args.user or su.DEFAULT_USER
    if args.user and args.user != su.DEFAULT_USER and not target.user_exists(args.user):
        raise SwarmError(f"there is no user '{args.user}' on {'this system' if target.live else target.root}: "
                         f"create it first, or leave out --user to run as the '{su.DEFAULT_USER}' system user")
    new_token = read_token_file(args.token_file) if args.token_file else None
    steps: list[Step] = []
    notes: list[str] = []

    if user == su.DEFAULT_USER:
        write_step(steps, target.path(su.SYSUSERS_PATH), su.sysusers_text(user))
        if target.live and not target.user_exists(user):
            steps.append(Step(f"create the system user {user} (systemd-sysusers {su.SYSUSERS_PATH})",
                              lambda: run_command(["systemd-sysusers", su.SYSUSERS_PATH])))

    config_file = target.path(su.CONFIG_PATH)
    existing = read_settings(config_file) if config_file.is_file() else None
    base = existing or JoinSettings(port=DEFAULT_PORT, token_file=f"{su.STATE_DIR}/token", state_dir=su.STATE_DIR,
                                    mdns=True)
    settings = merged(base, port=args.port, interface=args.interface, name=args.name)
    if settings != existing:
        write_step(steps, config_file, render_settings(settings, CONFIG_HEADER))

    token_file = target.path(settings.token_file or f"{settings.state_dir or su.STATE_DIR}/token")
    before = len(steps)
    token_steps(steps, notes, target, token_file, new_token)
    if target.live:
        ownership_step(steps, target.path(settings.state_dir or su.STATE_DIR), user, pending=len(steps) > before)

    unit_dir = target.path(su.UNIT_DIR)
    unit_file = unit_dir / su.UNIT_NAME
    dropin = unit_dir / f"{su.UNIT_NAME}.d" / su.GPU_DROPIN
    units_before = len(steps)
    write_step(steps, unit_file, su.unit_text(agent_command(target, notes), user,
                                              memory=device_memory(args, target, notes)))
    gpu = args.gpu
    if gpu == "auto":
        sign = next((p for p in GPU_SIGNS if target.path(p).exists()), None)
        gpu = "yes" if sign else "keep"
        if sign:
            notes.append(f"GPU found ({sign}): the agent may use it (drop-in {dropin})")
    if gpu == "yes":
        groups = [g for g in su.GPU_GROUPS if target.group_exists(g)]
        write_step(steps, dropin, su.gpu_dropin_text(groups))
    elif gpu == "no" and dropin.exists():
        steps.append(Step(f"remove {dropin}", lambda: remove_file(dropin, prune=True)))
    units_changed = len(steps) > units_before

    changed = bool(steps)
    if target.systemd_running():
        if units_changed:
            steps.append(Step("reload systemd (systemctl daemon-reload)",
                              lambda: run_command(["systemctl", "daemon-reload"])))
        enabled = systemctl_ok("is-enabled", su.UNIT_NAME)
        active = systemctl_ok("is-active", su.UNIT_NAME)
        if not enabled or not active:
            command = ["systemctl", "enable"] + ([] if active else ["--now"]) + [su.UNIT_NAME]
            steps.append(Step(f"{'enable' if active else 'enable and start'} the service ({' '.join(command)})",
                              lambda: run_command(command)))
        if active and changed:
            steps.append(Step("restart the service with its new settings (systemctl restart swarm.service)",
                              lambda: run_command(["systemctl", "restart", su.UNIT_NAME])))
        notes.append("check it: systemctl status swarm; journalctl -u swarm -f; sudo swarm status")
    else:
        link = target.path(f"{su.UNIT_DIR}/multi-user.target.wants/{su.UNIT_NAME}")
        wanted = f"{su.UNIT_DIR}/{su.UNIT_NAME}"
        if not (link.is_symlink() and os.readlink(link) == wanted):
            steps.append(Step(f"enable the service at boot (link {link} -> {wanted})", lambda: make_link(link, wanted)))
        if target.live:
            notes.append("systemd is not running here: the service starts at the next boot")
        else:
            notes.append(f"files written under {target.root}: on that system, systemd-sysusers creates the "
                         f"user at boot and the service starts at boot")
    return steps, notes


def token_steps(steps, notes, target: Target, token_file: Path, new_token: str | None) -> None:
    from swarm.host.state import new_token as make_token
    from swarm.host.state import read_token_file

    current = None
    if token_file.is_file():
        try:
            current = read_token_file(token_file)
        except SwarmError:
            if new_token is None:   # (says what is wrong with it and how to make a good one)
                raise
    if new_token is not None and new_token != current:
        what = "replace the cluster token in" if token_file.is_file() else "install the cluster token in"
        steps.append(Step(f"{what} {token_file}", lambda: write_secret(token_file, new_token)))
    elif new_token is None and current is None:
        steps.append(Step(f"create a new cluster token in {token_file} (the first device of a cluster)",
                          lambda: write_secret(token_file, make_token())))
        notes.append("this device has a new cluster token: print it with `sudo swarm token` and install the other "
                     "devices with --token-file FILE")


def agent_command(target: Target, notes: list[str]) -> list[str]:
    """How the service runs swarm: this installation's `swarm` script, else `python -m swarm`,
    as a path on the target system."""
    exe = Path(sys.executable)
    script = exe.parent / "swarm"
    command = [str(script)] if script.is_file() and os.access(script, os.X_OK) else [str(exe), "-m", "swarm"]
    command[0] = target.inside(command[0])
    for path in (command[0], target.inside(str(exe.resolve()))):  # the script, and the interpreter behind it
        hidden = [d for d in HIDDEN_FROM_SERVICE if Path(path).is_relative_to(d)]
        if hidden:
            notes.append(f"warning: the service cannot see {hidden[0]} (ProtectHome=, PrivateTmp=), where {path} "
                         f"is: install swarm under /opt with deploy/install.sh")
            break
    return command


def device_memory(args, target: Target, notes: list[str]) -> int:
    """The memory (bytes) the unit's limits are made for: --memory, else this system's."""
    if args.memory:
        return args.memory
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")   # MemTotal
    if not target.live:
        from swarm.service.unit import size_text

        notes.append(f"note: the unit's memory limit is made for this system's {size_text(total)}: for an image "
                     f"of a device with other memory, give --memory SIZE")
    return total


# -- uninstall --------------------------------------------------------------------------

def uninstall_steps(args, target: Target) -> tuple[list[Step], list[str]]:
    from swarm.service import unit as su

    unit_dir = target.path(su.UNIT_DIR)
    unit_file = unit_dir / su.UNIT_NAME
    dropin_dir = unit_dir / f"{su.UNIT_NAME}.d"
    link = unit_dir / "multi-user.target.wants" / su.UNIT_NAME
    steps: list[Step] = []
    if target.systemd_running() and unit_file.exists():
        steps.append(Step("stop and disable the service (systemctl disable --now swarm.service)",
                          lambda: run_command(["systemctl", "disable", "--now", su.UNIT_NAME])))
    if link.is_symlink() and not (target.systemd_running() and unit_file.exists()):  # else `disable` removes it
        steps.append(Step(f"remove {link}", lambda: remove_file(link)))
    if (dropin_dir / su.GPU_DROPIN).exists():
        steps.append(Step(f"remove {dropin_dir / su.GPU_DROPIN}",
                          lambda: remove_file(dropin_dir / su.GPU_DROPIN, prune=True)))
    if unit_file.exists():
        steps.append(Step(f"remove {unit_file}", lambda: remove_file(unit_file)))
    if steps and target.systemd_running():
        steps.append(Step("reload systemd (systemctl daemon-reload)",
                          lambda: run_command(["systemctl", "daemon-reload"])))
    config_file, state_dir = target.path(su.CONFIG_PATH), target.path(su.STATE_DIR)
    notes = []
    if args.purge:
        if config_file.exists():
            steps.append(Step(f"remove {config_file}", lambda: remove_file(config_file, prune=True)))
        if target.path(su.SYSUSERS_PATH).exists():
            steps.append(Step(f"remove {target.path(su.SYSUSERS_PATH)}",
                              lambda: remove_file(target.path(su.SYSUSERS_PATH))))
        if state_dir.exists():
            steps.append(Step(f"remove {state_dir} (token, node id, profiles, checkpoints)",
                              lambda: shutil.rmtree(state_dir)))
    elif config_file.exists() or state_dir.exists():
        notes.append(f"kept {config_file} and {state_dir} (token, node id): --purge removes them")
    return steps, notes


# -- taking steps -----------------------------------------------------------------------

def write_step(steps: list[Step], path: Path, text: str, mode: int = 0o644) -> None:
    """Add a step writing `text` to `path`, unless it holds exactly that already."""
    try:
        if path.read_text() == text:
            return
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    except OSError as exc:
        raise SwarmError(f"cannot read {path}: {exc.strerror}") from None
    steps.append(Step(f"write {path}", lambda: write_file(path, text, mode)))


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        raise SwarmError(f"cannot write {path}: {exc.strerror}") from None


def write_secret(path: Path, token: str) -> None:
    """The token, readable by its owner only (the service user's, once ownership_step has run)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise SwarmError(f"cannot create {path.parent}: {exc.strerror}") from None
    write_file(path, token + "\n", 0o600)


def ownership_step(steps: list[Step], state_dir: Path, user: str, pending: bool) -> None:
    """Hand the state directory to the service user where anything in it belongs to someone else
    (a token just written by root, files of an earlier `sudo swarm join`); `pending`: an earlier
    step writes there. StateDirectory= does this at start only when the directory itself has
    another owner."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        uid = None  # the sysusers step creates the user
    if not pending:
        if not state_dir.exists():
            return
        if uid is not None and all(p.lstat().st_uid == uid for p in [state_dir, *state_dir.rglob("*")]):
            return

    def chown_all() -> None:
        owner = pwd.getpwnam(user)
        for p in [state_dir, *state_dir.rglob("*")]:
            os.lchown(p, owner.pw_uid, owner.pw_gid)

    steps.append(Step(f"hand {state_dir} to user {user}", chown_all))


def make_link(link: Path, target: str) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def remove_file(path: Path, prune: bool = False) -> None:
    """Remove `path`; with prune, its directory too if that is now empty (a drop-in directory, /etc/swarm)."""
    path.unlink(missing_ok=True)
    if prune:
        try:
            path.parent.rmdir()
        except OSError:
            pass


def run_command(command: list[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise SwarmError(f"{command[0]} not found: is systemd installed?") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise SwarmError(f"`{' '.join(command)}` failed ({detail[-1] if detail else f'exit {done.returncode}'})")


def systemctl_ok(verb: str, unit: str) -> bool:
    try:
        return subprocess.run(["systemctl", verb, "--quiet", unit], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False
