#!/usr/bin/env bash
# The test suite: sets up .venv if needed, then runs pytest. Extra arguments go to pytest.
# Two pytest-xdist workers (AUTOPAR_TEST_WORKERS; 0 runs in this process): the multi-process
# launches all run on one worker, one after another (tests/conftest.py), single-process tests
# on the other.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python -m pytest -q -n "${AUTOPAR_TEST_WORKERS:-2}" --dist loadgroup "$@"
