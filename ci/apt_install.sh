#!/usr/bin/env bash
# Install Debian packages for the tests' servers, without starting their services, and check that
# the binaries they should provide are on PATH.  Safe to run again: returns at once when every
# binary is there already.  Used by ci/install_prometheus.sh and ci/install_redis.sh.
#
#   ci/apt_install.sh "PACKAGE [PACKAGE...]" BINARY [BINARY...]
#
# Needs root or passwordless sudo.  Prints each binary's version line.
set -euo pipefail

PACKAGES=$1
shift
BINARIES=("$@")

have() { command -v "$1" >/dev/null 2>&1; }

show() {
    for b in "${BINARIES[@]}"; do
        "$b" --version 2>&1 | head -n1
    done
}

missing=0
for b in "${BINARIES[@]}"; do
    have "$b" || missing=1
done
if [ "$missing" -eq 0 ]; then
    show
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo; then
        SUDO="sudo -n"
    else
        echo "apt_install.sh: need root or sudo to apt-get install $PACKAGES" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive

# Keep the packages' postinst from starting a system-wide service (containers without systemd
# would otherwise try invoke-rc.d); the tests start their own servers on free loopback ports.
# Only when no policy is in place already, and removed again on exit.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    trap '$SUDO rm -f "$POLICY"' EXIT
fi

# apt-get update only when the package index does not know the packages yet.
for p in $PACKAGES; do
    if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        $SUDO apt-get update -qq
        break
    fi
done
# shellcheck disable=SC2086  # a list of package names
$SUDO apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null

for b in "${BINARIES[@]}"; do
    if ! have "$b"; then
        echo "apt_install.sh: the packages '$PACKAGES' did not provide '$b' on PATH" >&2
        exit 1
    fi
done
show
