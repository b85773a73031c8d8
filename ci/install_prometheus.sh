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
exec bash "$(dirname "$0")/apt_install.sh" prometheus prometheus promtool
