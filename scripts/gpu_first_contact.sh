#!/usr/bin/env bash
# The first ten minutes on a GPU node (benchmarks/gpu_first_contact.py, docs/gpu.md "First
# contact"): the embedded engine's tokens/s, a bf16 trainer step of a random ~1B Qwen2 at
# 8k-token micro-batches with MFU, the colocated memory hand-off, a CUDA IPC weight bucket
# between two processes, a short run of the tiny config with its `armor report` page
# (benchmarks/throughput_run.py), then every `gpu` test the installed packages allow. One JSON report;
# exit 1 naming the first broken check; without a GPU it says so and exits 0.
#
#   scripts/gpu_first_contact.sh [--out runs/gpu_first_contact.json] [--budget-s 480]
#
# ARMOR_PYTHON: the Python with torch, this project and megatron-core (default: .venv's, else
# python3). A hard bound of budget + 60 s stops a hung check.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${ARMOR_PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
BUDGET=480
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" != --budget-s ] || BUDGET=${args[$((i + 1))]:-480}
done
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=TERM --kill-after=30 "$((${BUDGET%.*} + 60))" \
  "$PYTHON" "$ROOT/benchmarks/gpu_first_contact.py" "$@"
