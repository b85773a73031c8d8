#!/usr/bin/env bash
# Install redis-server and redis-cli from Debian's `redis-server` package (redis-cli comes with its
# dependency redis-tools), for the remote tier's tests against real servers (tests/redis_servers.py).
# Called by .ci/run; safe to run again: returns at once when both binaries are already on PATH.
#
#   ci/install_redis.sh            # install if missing, print versions
#
# Needs root or passwordless sudo.  The package's service is NOT started: the tests start their
# own servers on free loopback ports.
set -euo pipefail
exec bash "$(dirname "$0")/apt_install.sh" "redis-server redis-tools" redis-server redis-cli
