#!/usr/bin/env bash
# Set up everything the tests need, then run every test tier this machine supports.
# unit + dist + e2e always; slurm when Slurm can be installed (root + apt); gpu only with CUDA.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m unit`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ -x slurm/ci/install_slurm.sh ]; then
  bash slurm/ci/install_slurm.sh || echo "test.sh: Slurm could not be installed; slurm tier will report it" >&2
fi
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
