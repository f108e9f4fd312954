#!/usr/bin/env bash
# Install geosched with its test dependencies, check style, types and import layers, then run the tests.
# Mosquitto (the real MQTT broker some tests start) comes from Debian's
# packages; it is installed here when missing and we may use apt.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null
  else
    echo "warning: mosquitto not found; install it (apt-get install mosquitto) or the broker tests skip" >&2
  fi
fi
bash scripts/install.sh test
bash scripts/check.sh
# two pytest workers (CI's 2 cores; PYTEST_WORKERS=N for another count, 0 for none), each test on whichever is
# free: most tests wait on processes, sockets and timeouts. Not '-n auto': it counts a container's host cores.
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist worksteal "$@"
