#!/usr/bin/env bash
# Install Prometheus and promtool from Debian's `prometheus` package, for the
# tests that run dashboard and alert queries against a real server
# (tests/test_prometheus_e2e.py).  Called by .ci/run; safe to run again:
# returns at once when both binaries are already on PATH.
#
#   ci/install_prometheus.sh            # install if missing, print versions
#
# Needs root or passwordless sudo.  The package's service is NOT started: the
# tests start their own server on a free loopback port.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

show() {
    prometheus --version 2>&1 | head -n1
    promtool --version 2>&1 | head -n1
}

if have prometheus && have promtool; then
    show
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo; then
        SUDO="sudo -n"
    else
        echo "install_prometheus.sh: need root or sudo to apt-get install prometheus" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive

# Keep the package's postinst from starting a system-wide Prometheus on :9090
# (containers without systemd would otherwise try invoke-rc.d).  Only when no
# policy is in place already, and removed again on exit.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    trap '$SUDO rm -f "$POLICY"' EXIT
fi

# apt-get update only when the package index does not know the package yet.
if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null

for b in prometheus promtool; do
    if ! have "$b"; then
        echo "install_prometheus.sh: the prometheus package did not provide '$b' on PATH" >&2
        exit 1
    fi
done
show
