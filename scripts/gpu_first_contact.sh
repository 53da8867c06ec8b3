#!/usr/bin/env bash
# The first minutes on a GPU node (benchmarks/gpu_first_contact.py, docs/gpu.md "First
# contact"): a random ~1B Qwen2, the embedded engine's tokens/s, a bf16 trainer step at
# 8k-token micro-batches with MFU, the colocated memory hand-off, a CUDA IPC weight bucket
# between two processes, a short run of the tiny config with its `armor report` page
# (benchmarks/throughput_run.py), then the gpu tests that show what only a GPU can. Each check
# within its H100 budget (475 s in all); one JSON report, rewritten after every check; exit 1
# naming the first broken check; without a GPU it says so and exits 0.
#
#   scripts/gpu_first_contact.sh [--out runs/gpu_first_contact.json] [--rehearse]
#
# --rehearse: the same checks in the same order on CPU (CUDA_VISIBLE_DEVICES emptied), each
# within its CPU deadline; the README's test command runs it. ARMOR_PYTHON: the Python with
# torch, this project and megatron-core (default: .venv's, else python3). A hard bound
# (600 s; 1200 s rehearsing) stops an interpreter too wedged for the per-check deadlines.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${ARMOR_PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
BOUND=600
for arg in "$@"; do
  if [ "$arg" = --rehearse ]; then
    BOUND=1200
    export CUDA_VISIBLE_DEVICES=""
  fi
done
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=TERM --kill-after=30 "$BOUND" \
  "$PYTHON" "$ROOT/benchmarks/gpu_first_contact.py" "$@"
