#!/usr/bin/env bash
# The main job: sets up .venv if needed, then runs autopar on the default model.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
python -m autopar "${@:-demo}"
