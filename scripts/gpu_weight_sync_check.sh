#!/usr/bin/env bash
# Weight-sync checks on one GPU node (docs/gpu.md "Weight-sync checks"): the gpu-tier tests of
# every trainer-owned transport (tensor / distributed / disk into a real SGLang server) and the
# bandwidth of each transport next to the object-store path. A few minutes on one GPU.
#
#   scripts/gpu_weight_sync_check.sh [--mb 1024]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
python -m pytest -m gpu tests/gpu/test_weight_sync_gpu.py -q -rs
if [ $# -eq 0 ]; then set -- --mb 1024; fi
python benchmarks/bench_weight_sync.py --device cuda "$@"
