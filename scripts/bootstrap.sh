#!/usr/bin/env bash
# Create/refresh the project's virtualenv (.venv): torch pinned and installed first, then the
# CPU stack, then the package itself. Idempotent: skips installs when requirements are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ARMOR_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.armor-installed"
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/pip" install -q --upgrade pip
  # torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q -r requirements.txt
  "$VENV/bin/pip" install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
