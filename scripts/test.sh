#!/usr/bin/env bash
# Install k3ray with its test dependencies into a fresh virtual environment (no system site-packages, so an
# undeclared dependency fails here as it would for a user), check that every import is declared, run the suite.
# Prometheus comes from Debian (the metrics tests start one). Extra arguments go to pytest.
# The suite runs in two processes (pytest-xdist, K3RAY_TEST_WORKERS), each with its own Ray cluster, a test file
# to one process (its module fixtures, a serving engine or a reference run, are built once): much of a Ray test is
# waiting (process starts, timeouts), so two overlap on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v prometheus >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) >/dev/null
fi
venv="${K3RAY_TEST_VENV:-build/test-venv}"
rm -rf "$venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
# Local pip configs may name index folders that do not exist; pip then warns once per package.
python -m pip install -q torch==2.13.0 -e '.[dev]' 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
deptry .
export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
python -m pytest -q -p no:cacheprovider -n "${K3RAY_TEST_WORKERS:-2}" --dist loadfile "$@"
