#!/usr/bin/env bash
# The swarm service under a real systemd, end to end, on a machine where systemd is not PID 1
# (a development container): boots a throwaway copy of this machine's OS with systemd-nspawn
# (an overlay on tmpfs, so nothing is written to the machine; a network namespace with only
# lo), runs deploy/install.sh in it twice, and checks what a device would do: READY=1 with
# its status text, `swarm status`, the state directory handed to the service user, the
# resource limits, a token replaced by a re-install, a frozen agent killed by the watchdog
# and restarted, a clean stop (exit 0), and uninstall.
#
#   sudo deploy/check-in-container.sh [--wheelhouse DIR] [--python PY] [--pip-args ARGS]
#
# Needs root, systemd-nspawn (apt-get install systemd-container), overlayfs, python3-venv in
# the OS, and, once, the package index: the wheels go to a wheelhouse (default
# /var/tmp/swarm-wheelhouse) that later runs reuse; the container itself has no network.
# --pip-args: where pip finds a CPU torch (default: the PyTorch CPU index as an extra index).
# Takes 2-4 minutes (pip installs torch in the container; the watchdog test waits 45 s).
set -euo pipefail

WHEELHOUSE=/var/tmp/swarm-wheelhouse PY=python3 PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
while [ $# -gt 0 ]; do
    case $1 in
        --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --pip-args) PIP_ARGS=$2; shift 2 ;;
        *) echo "usage: $0 [--wheelhouse DIR] [--python PY] [--pip-args ARGS]" >&2; exit 2 ;;
    esac
done
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "check-in-container.sh: run it as root" >&2; exit 2; }
command -v systemd-nspawn >/dev/null || { echo "check-in-container.sh: apt-get install systemd-container" >&2; exit 2; }

# -- the wheels: swarm from this tree, its dependencies (a CPU torch) ----------------------
WORK=$(mktemp -d /var/tmp/swarm-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WHEELHOUSE" "$WORK/src" "$WORK/results"
cp -r "$REPO/swarm" "$REPO/tiles" "$REPO/planner" "$REPO/pyproject.toml" "$REPO/README.md" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$WHEELHOUSE"/swarm_train-*.whl
"$PY" -m pip wheel --quiet --no-deps -w "$WHEELHOUSE" "$WORK/src"
WHEEL=$(basename "$(ls "$WHEELHOUSE"/swarm_train-*.whl)")
# shellcheck disable=SC2086  # --pip-args is split into words on purpose
"$PY" -m pip download --quiet -c "$REPO/constraints.txt" $PIP_ARGS --only-binary :all: -d "$WHEELHOUSE" \
    "$WHEELHOUSE/$WHEEL"

# -- what runs inside ----------------------------------------------------------------------
cat >"$WORK/check.sh" <<EOF
#!/bin/bash
exec >/results/log 2>&1
WHEEL=/wheelhouse/$WHEEL
EOF
cat >>"$WORK/check.sh" <<'EOF'
install() { bash /src/deploy/install.sh --from "$WHEEL" --pip-args "--no-index --find-links /wheelhouse" \
                --interface lo --name box1 "$@"; }
expect() {  # expect WHAT COMMAND...: one line of the verdict
    if "${@:2}"; then echo "PASS $1" >>/results/verdict; else echo "FAIL $1" >>/results/verdict; fi
}
prop() { systemctl show swarm.service -p "$1" --value; }
set -x
install >/results/first; cat /results/first
expect "first install enables and starts the service" grep -q "enable and start the service" /results/first
expect "READY=1 and the status text" test "$(prop ActiveState)/$(prop StatusText)" = "active/serving on port 4750"
expect "the state directory belongs to the service user" test "$(stat -c %U /var/lib/swarm/token)" = swarm
expect "the resource limits are in force" \
    test "$(prop LimitNOFILE)/$(prop TasksMax)" = 16384/512 -a "$(prop MemoryMax)" != infinity
expect "swarm status finds the agent" bash -c 'SWARM_INTERFACE=lo swarm status --wait 3 | grep -q "box1 .* alive"'
install >/results/second; cat /results/second
expect "a second install has nothing to do" grep -q "^nothing to do" /results/second
swarm token --new >/root/token.txt
install --token-file /root/token.txt >/results/token; cat /results/token
expect "a new token is installed and the agent restarted" grep -q "restart the service" /results/token
expect "swarm token prints it" test "$(swarm token)" = "$(cat /root/token.txt)"
pid=$(prop MainPID)
if [ "$pid" -gt 0 ]; then kill -STOP "$pid"; sleep 45; fi   # (never kill 0: that is this script's group)
expect "the watchdog restarts a frozen agent" test "$(prop NRestarts)/$(prop ActiveState)" = "1/active"
journalctl -u swarm --no-pager | grep -q "Watchdog timeout"; expect "systemd saw the watchdog timeout" test $? = 0
systemctl stop swarm
expect "SIGTERM: goodbye and exit 0" test "$(prop ExecMainStatus)/$(prop Result)" = "0/success"
expect "the agent said goodbye" bash -c 'journalctl -u swarm --no-pager | grep -q "SIGTERM: saying goodbye"'
systemd-analyze security swarm | tail -1
swarm service uninstall
expect "uninstall removes the unit" test ! -e /etc/systemd/system/swarm.service
journalctl -u swarm --no-pager | tail -20
systemctl poweroff
EOF
chmod +x "$WORK/check.sh"

# -- boot it -------------------------------------------------------------------------------
unshare --mount --propagation private bash -euc '
    WORK=$1 REPO=$2 WHEELHOUSE=$3
    mkdir -p "$WORK/ovl"
    mount -t tmpfs -o size=8G tmpfs "$WORK/ovl"
    mkdir "$WORK/ovl/up" "$WORK/ovl/work" "$WORK/ovl/root"
    mount -t overlay overlay -o lowerdir=/,upperdir="$WORK/ovl/up",workdir="$WORK/ovl/work" "$WORK/ovl/root"
    R=$WORK/ovl/root
    mountpoint -q "$R"   # (set -e) never clean up anything but the overlay
    rm -rf "$R/opt/swarm" "$R/etc/swarm" "$R/var/lib/swarm" "$R/etc/systemd/system/swarm.service"* \
           "$R/etc/systemd/system/multi-user.target.wants/swarm.service"
    mkdir -p "$R/src" "$R/wheelhouse" "$R/results"
    cp "$WORK/check.sh" "$R/check.sh"
    printf "[Service]\nType=oneshot\nExecStart=/check.sh\nTimeoutStartSec=20min\n" \
        >"$R/etc/systemd/system/swarm-check.service"
    printf "[Unit]\nRequires=basic.target swarm-check.service\nAfter=basic.target\n" \
        >"$R/etc/systemd/system/swarm-check.target"
    exec timeout 1500 systemd-nspawn --quiet --register=no --keep-unit --private-network -D "$R" \
        --bind-ro="$REPO:/src" --bind-ro="$WHEELHOUSE:/wheelhouse" --bind="$WORK/results:/results" \
        --console=pipe --boot systemd.unit=swarm-check.target >"$WORK/results/boot" 2>&1
' check "$WORK" "$REPO" "$WHEELHOUSE" || true

if [ ! -s "$WORK/results/verdict" ]; then
    echo "check-in-container.sh: the container ran no check; its output:" >&2
    tail -30 "$WORK/results/boot" "$WORK/results/log" 2>/dev/null >&2
    exit 1
fi
cat "$WORK/results/verdict"
grep -h "Overall exposure" "$WORK/results/log" || true
if grep -q '^FAIL' "$WORK/results/verdict"; then
    echo "--- the container's log:"; tail -60 "$WORK/results/log"
    exit 1
fi
echo "all passed"
