#!/usr/bin/env bash
# Install redis-server and redis-cli from Debian's `redis-server` package, for
# the remote tier's tests against real servers (tests/redis_servers.py,
# tests/test_remote_store*.py).  Called by .ci/run; safe to run again:
# returns at once when both binaries are already on PATH.
#
#   ci/install_redis.sh            # install if missing, print versions
#
# Needs root or passwordless sudo.  The package's service is NOT started: the
# tests start their own servers on free loopback ports.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

show() {
    redis-server --version 2>&1 | head -n1
    redis-cli --version 2>&1 | head -n1
}

if have redis-server && have redis-cli; then
    show
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo; then
        SUDO="sudo -n"
    else
        echo "install_redis.sh: need root or sudo to apt-get install redis-server" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive

# Keep the package's postinst from starting a system-wide Redis on :6379
# (containers without systemd would otherwise try invoke-rc.d).  Only when no
# policy is in place already, and removed again on exit.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    trap '$SUDO rm -f "$POLICY"' EXIT
fi

# apt-get update only when the package index does not know the package yet.
if ! apt-cache policy redis-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
# redis-server depends on redis-tools, which provides redis-cli
$SUDO apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null

for b in redis-server redis-cli; do
    if ! have "$b"; then
        echo "install_redis.sh: the redis-server package did not provide '$b' on PATH" >&2
        exit 1
    fi
done
show
