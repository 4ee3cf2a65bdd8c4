#!/usr/bin/env bash
# The main job: sets up .venv if needed, then, with no arguments, (1) plans gpt2 on 8 A100s and
# prints the strategy report, and (2) plans and trains the tiny GPT on 4 CPU processes (gloo)
# with the plan autopar chooses, printing its loss next to a single-process run's.
# With arguments, runs `python -m autopar ARGS...` instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
  exec python -m autopar "$@"
fi
python -m autopar demo
echo
echo "== train the tiny GPT on 4 CPU processes with autopar's plan (2 MB per-device budget, so it shards) =="
OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 4 \
  examples/train_gpt.py --steps 5 --memory-budget-mb 2
