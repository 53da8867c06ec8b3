#!/usr/bin/env bash
# Create/refresh the project's virtualenv (.venv) for CPU machines and CI: the CPU torch pin
# (requirements-cpu.txt) installed first, then the shared stack, then the package itself. GPU
# machines use requirements-gpu.txt instead of requirements-cpu.txt (docs/gpu.md).
# Idempotent: skips installs when requirements are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ARMOR_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.armor-installed"
want=$(cat requirements-cpu.txt requirements.txt requirements-wandb.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/pip" install -q --upgrade pip
  # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
  "$VENV/bin/pip" install -q -r requirements-cpu.txt
  "$VENV/bin/pip" install -q -r requirements.txt
  "$VENV/bin/pip" install -q -r requirements-wandb.txt   # the W&B tests log offline
  "$VENV/bin/pip" install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
