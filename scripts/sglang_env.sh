#!/usr/bin/env bash
# Create/refresh the virtualenv of the sglang test tier: the real SGLang server on CPU.
#
# Its own environment because SGLang pins its torch (requirements-gpu.txt: torch 2.14.1, the
# CUDA-13 wheel, which imports fine without a GPU) and the CPU .venv pins torch 2.13.0. It holds
# the GPU nodes' stack minus Transformer Engine (CUDA-only): the SGLang pins of
# requirements-gpu.txt, then requirements.txt, so the project's code runs there as on a GPU node.
# The project itself is not installed: the tier runs with PYTHONPATH at the checkout, so one
# cached venv serves every clone. The test-only CPU guards (tests/sglang_tier/armor_sglang_cpu_guards.py)
# are copied into its site-packages with a .pth line that imports them at start-up.
#
# Cached at $ARMOR_SGLANG_VENV (default ~/.cache/megatron_armor/sglang-venv), ~11 GB, ~5-10 min
# the first time; idempotent: skipped when the pins, requirements.txt and the guards are unchanged.
# Prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ARMOR_SGLANG_VENV:-$HOME/.cache/megatron_armor/sglang-venv}
PY=${PYTHON:-python3}
GUARDS=tests/sglang_tier/armor_sglang_cpu_guards.py
pins=$(grep -E '^(torch|sglang|sglang-router)==' requirements-gpu.txt)
[ "$(printf '%s\n' "$pins" | wc -l)" = 3 ] || {
  echo "sglang_env.sh: requirements-gpu.txt must pin torch, sglang and sglang-router (==)" >&2
  exit 2
}
stamp="$VENV/.armor-sglang-installed"
want=$( { printf '%s\n' "$pins"; cat requirements.txt "$GUARDS" "$0"; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "sglang_env.sh: installing the sglang test tier's virtualenv in $VENV (~11 GB)" >&2
  mkdir -p "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $pins
  "$VENV/bin/python" -m pip install -q -r requirements.txt
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$GUARDS" "$site/"
  echo "import armor_sglang_cpu_guards" > "$site/armor_sglang_cpu_guards.pth"
  "$VENV/bin/python" -c 'import sglang, sglang_router, megatron.core, ray' 2>/dev/null || {
    echo "sglang_env.sh: $VENV does not import sglang, sglang_router, megatron.core and ray" >&2
    exit 1
  }
  echo "$want" > "$stamp"
fi
echo "$VENV/bin/python"
