#!/usr/bin/env bash
# Create (or reuse) the local virtual environment .venv and install autopar into it,
# with torch pinned by constraints-cpu.txt. Sourced by scripts/main.sh and scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.autopar-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$ROOT/constraints-cpu.txt" -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  # torch first, from the pin, so no other requirement can pull a CUDA build.
  python -m pip install -q -c "$ROOT/constraints-cpu.txt" torch
  python -m pip install -q -c "$ROOT/constraints-cpu.txt" -e "$ROOT[test]"
  touch "$STAMP"
fi
# Byte-compile autopar's sources (an editable install leaves them as source, and where
# PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python never caches them): every
# process that imports autopar (the CLI, each test rank) then skips ~0.25 s of compiling.
# Up-to-date files are skipped; a stale .pyc is never used (Python checks the source's mtime).
python -m compileall -q "$ROOT/autopar" "$ROOT/passes" "$ROOT/cost_model" "$ROOT/runtime" > /dev/null
# Build csrc/'s fused CPU optimizer kernels once (~1-2 min; later runs reuse the build in
# .venv/var). Where no compiler is found autopar warns once and runs its torch fallback.
EXT_STAMP="$VENV/.autopar-ext-built"
if [ ! -f "$EXT_STAMP" ] || [ "$ROOT/csrc/fused_optim.cpp" -nt "$EXT_STAMP" ]; then
  OMP_NUM_THREADS=1 python -c "from autopar.optim.cpu_kernels import extension; extension()" && touch "$EXT_STAMP"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
