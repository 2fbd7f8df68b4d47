#!/usr/bin/env bash
# Install swarm on a Raspberry Pi, a Jetson or a laptop: a virtual environment in
# /opt/swarm/venv, the package, a `swarm` command in /usr/local/bin, and the swarm service.
# Safe to repeat: each step runs only when something differs, so a second run ends with
# "nothing to do".
#
#   sudo deploy/install.sh                          # the first device: makes the cluster token
#   sudo deploy/install.sh --token-file token.txt   # the others: the token from `sudo swarm token`
#   deploy/install.sh --dry-run                     # print the steps, change nothing
#   deploy/install.sh --root DIR                    # install under DIR (an image): no apt, no systemctl
#
# Options:
#   --token-file F, --user U, --gpu auto|yes|no, --port N, --interface NAME, --name NAME,
#   --memory SIZE   passed to `swarm service install` (see `swarm service install --help`)
#   --from SRC      what to install: a source tree, a wheel or a pip requirement
#                   (default: the source tree this script is in)
#   --python PY     the Python (3.10 or newer) to build the environment from (default: python3)
#   --pip-args A    more pip arguments, e.g. "--extra-index-url https://download.pytorch.org/whl/cpu"
#   --upgrade       install the package again even if this very source is installed
#
# torch: where `python3` already imports a torch (NVIDIA's build on a Jetson), the environment
# sees the system packages and pip is constrained to that torch (and a numpy it works with), so
# it is never replaced. Elsewhere pip installs torch from the package index.
set -euo pipefail

ROOT="" DRY=0 UPGRADE=0 PY=python3 SRC="" PIP_ARGS="" SERVICE_ARGS=() NEW_PACKAGE=""
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 2; }
need_value() { [ $# -ge 2 ] || die "$1 needs a value"; }

while [ $# -gt 0 ]; do
    case $1 in
        --root) need_value "$@"; ROOT=$(realpath -m "$2"); shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --upgrade) UPGRADE=1; shift ;;
        --python) need_value "$@"; PY=$2; shift 2 ;;
        --from) need_value "$@"; SRC=$2; shift 2 ;;
        --pip-args) need_value "$@"; PIP_ARGS=$2; shift 2 ;;
        --token-file) need_value "$@"; [ -f "$2" ] || die "token file $2 does not exist"
                      SERVICE_ARGS+=(--token-file "$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift 2 ;;
        --user|--gpu|--port|--interface|--name|--memory) need_value "$@"; SERVICE_ARGS+=("$1" "$2"); shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

OPT=$ROOT/opt/swarm
VENV=$OPT/venv
CHANGES=0

# act WHAT COMMAND...: take one step (with --dry-run, only say it)
act() {
    local what=$1; shift
    CHANGES=$((CHANGES + 1))
    if [ "$DRY" = 1 ]; then echo "would $what"; else echo "+ $what"; "$@"; fi
}
ok() { echo "ok: $*"; }
venv_python() { env -u PYTHONPATH "$VENV/bin/python" "$@"; }

# -- preconditions -----------------------------------------------------------------------
if [ -z "$ROOT" ] && [ "$DRY" = 0 ] && [ "$(id -u)" != 0 ]; then
    die "this installs into /opt and /etc: run it as root (sudo $0 ...), or use --dry-run or --root DIR"
fi
command -v "$PY" >/dev/null || die "$PY not found: install Python 3.10 or newer"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    die "swarm needs Python 3.10 or newer; $PY is $("$PY" -c 'import sys; print(sys.version.split()[0])')" \
        "(Raspberry Pi OS bookworm and JetPack 6 have it)"
if [ -z "$SRC" ]; then
    [ -f "$HERE/../pyproject.toml" ] || die "no --from given and $HERE/.. is not a swarm source tree"
    SRC=$(cd "$HERE/.." && pwd)
fi
[ -e "$SRC" ] && SRC=$(cd "$(dirname "$SRC")" && pwd)/$(basename "$SRC")   # a path: made absolute

# -- Python's venv module ----------------------------------------------------------------
if env -u PYTHONPATH "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
    ok "$PY can make virtual environments"
elif [ -z "$ROOT" ] && command -v apt-get >/dev/null; then
    act "install python3-venv (apt-get)" apt-get install -y python3-venv
else
    die "$PY cannot make virtual environments: install python3-venv"
fi

# -- jemalloc: swarm runs on it where it is installed (less memory a sample; optional) -------
if ls /usr/lib/*-linux-gnu*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2 /usr/lib/libjemalloc.so.2 \
        /usr/local/lib/libjemalloc.so.2 >/dev/null 2>&1; then
    ok "jemalloc is installed: swarm runs on it"
elif [ -z "$ROOT" ] && command -v apt-get >/dev/null; then
    act "install libjemalloc2 (apt-get)" sh -c 'apt-get install -y libjemalloc2 || echo "no libjemalloc2: swarm uses glibc malloc"'
else
    ok "no jemalloc here: swarm uses the system's malloc (a device holds fewer samples)"
fi

# -- a torch that is already there (NVIDIA's, on a Jetson) -------------------------------
dist_version() {  # the installed version of a distribution, as $PY sees it ("" if none)
    env -u PYTHONPATH "$PY" - "$1" <<'EOF' 2>/dev/null || true
import importlib.metadata, importlib.util, sys
name = sys.argv[1]
if importlib.util.find_spec(name) is not None:
    try:
        print(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(__import__(name).__version__)
EOF
}
TORCH=$(dist_version torch)
if [ -n "$TORCH" ]; then
    ok "$PY has torch $TORCH: the environment uses it (--system-site-packages) and pip keeps it"
fi

# -- the virtual environment -------------------------------------------------------------
if [ -x "$VENV/bin/python" ]; then
    ok "virtual environment $VENV"
    shared=$(sed -n 's/^include-system-site-packages *= *//p' "$VENV/pyvenv.cfg" 2>/dev/null)
    if [ -n "$TORCH" ] && [ "$shared" != true ]; then
        echo "warning: $VENV does not see the system's torch $TORCH; to use it, remove $VENV and run this again" >&2
    fi
else
    act "create the virtual environment $VENV${TORCH:+ (it sees the torch of $PY)}" \
        env -u PYTHONPATH "$PY" -m venv ${TORCH:+--system-site-packages} "$VENV"
fi
if [ -n "$TORCH" ] && [ -x "$VENV/bin/python" ] && ! venv_python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
    echo "warning: torch $TORCH of $PY is not visible in $VENV (is $PY itself in a virtual environment?)" >&2
fi

# -- the package -------------------------------------------------------------------------
CONSTRAINTS=$OPT/constraints.txt
if [ -n "$TORCH" ]; then
    NUMPY=$(dist_version numpy)
    numpy_pin="<2"   # a torch built against numpy 1 fails to load beside numpy 2
    if [ -n "$NUMPY" ] && [ "$(printf '%s\n' 1.24 "$NUMPY" | sort -V | head -n 1)" = 1.24 ]; then
        numpy_pin="==$NUMPY"   # the system's numpy is new enough for swarm: keep it too
    fi
    wanted=$(printf '%s\n' "# keep the torch of $PY (written by deploy/install.sh)" "torch==$TORCH" "numpy$numpy_pin")
    if [ "$(cat "$CONSTRAINTS" 2>/dev/null)" != "$wanted" ]; then
        act "write $CONSTRAINTS (pip keeps torch $TORCH)" eval 'mkdir -p "$OPT" && printf "%s\n" "$wanted" >"$CONSTRAINTS"'
    fi
fi

source_id() {  # what identifies this source: a hash of a tree or file, else the requirement itself
    if [ -d "$SRC" ]; then
        (cd "$SRC" && find . \( -name '.*' -o -name __pycache__ -o -name build -o -name '*.egg-info' \
            -o -name '*.pyc' \) -prune -o -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum |
            sed 's/ .*//; s/^/tree sha256:/')
    elif [ -f "$SRC" ]; then
        sha256sum "$SRC" | sed 's/ .*//; s/^/file sha256:/'
    else
        echo "requirement $SRC"
    fi
}
STAMP=$OPT/installed-from
SOURCE_ID=$(source_id)
install_package() {
    local constraints=()
    [ -f "$CONSTRAINTS" ] && constraints=(-c "$CONSTRAINTS")
    # shellcheck disable=SC2086  # --pip-args is split into words on purpose
    venv_python -m pip install --disable-pip-version-check "${constraints[@]}" $PIP_ARGS "$SRC"
    printf '%s\n' "$SOURCE_ID" >"$STAMP"
}
if [ "$UPGRADE" = 0 ] && [ -x "$VENV/bin/swarm" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$SOURCE_ID" ]; then
    ok "swarm installed from $SRC ($SOURCE_ID)"
else
    act "install swarm from $SRC into $VENV" install_package
    NEW_PACKAGE=1
fi

# -- the swarm command -------------------------------------------------------------------
LINK=$ROOT/usr/local/bin/swarm
if [ "$(readlink "$LINK" 2>/dev/null)" = /opt/swarm/venv/bin/swarm ]; then
    ok "$LINK"
else
    act "link $LINK -> /opt/swarm/venv/bin/swarm" eval 'mkdir -p "$(dirname "$LINK")" && ln -sfn /opt/swarm/venv/bin/swarm "$LINK"'
fi

# -- the service -------------------------------------------------------------------------
service=(service install ${ROOT:+--root "$ROOT"} ${SERVICE_ARGS[@]+"${SERVICE_ARGS[@]}"})
if [ ! -x "$VENV/bin/swarm" ]; then
    echo "would run: swarm ${service[*]}"   # only in a dry run: the package is not there yet
    CHANGES=$((CHANGES + 1))
else
    [ "$DRY" = 1 ] && service+=(--dry-run)
    out=$(env -u PYTHONPATH "$VENV/bin/swarm" "${service[@]}") || { printf '%s\n' "$out"; exit 2; }
    if printf '%s\n' "$out" | grep -q '^nothing to do'; then
        ok "swarm.service installed and up to date"
    else
        printf '%s\n' "$out"
        CHANGES=$((CHANGES + 1))
    fi
    # a running agent keeps the old code until restarted (unless the service step just (re)started it)
    if [ -n "$NEW_PACKAGE" ] && [ -z "$ROOT" ] && [ -d /run/systemd/system ] &&
        ! printf '%s\n' "$out" | grep -q 'start' && systemctl is-active --quiet swarm.service; then
        act "restart swarm.service to run the new package" systemctl restart swarm.service
    fi
fi

if [ "$CHANGES" = 0 ]; then
    echo "nothing to do: swarm is installed and up to date${ROOT:+ under $ROOT}"
elif [ "$DRY" = 1 ]; then
    echo "dry run: $CHANGES steps to take, nothing changed"
else
    echo "done${ROOT:+ under $ROOT}"
fi
