#!/usr/bin/env bash
# Install k3ray with its test dependencies (CPU torch, Prometheus from Debian) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v prometheus >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) >/dev/null
fi
python3 -m pip install -q torch==2.13.0 -e '.[dev]'
export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
python3 -m pytest -q -p no:cacheprovider "$@"
