#!/usr/bin/env bash
# Set up everything the tests need, then run every test tier this machine supports.
# unit + dist + e2e always; slurm when Slurm can be installed (root + apt); gpu only with CUDA.
# The CI Slurm cluster (two namespace nodes) is stopped at the end unless ARMOR_SLURM_KEEP=1.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m unit`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
slurm_started=0
if bash slurm/ci/install_slurm.sh; then
  slurm_started=1
else
  echo "test.sh: Slurm could not be installed or started; the slurm tier will report it" >&2
fi
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rc=0
.venv/bin/python -m pytest --durations=15 "$@" || rc=$?
if [ "$slurm_started" = 1 ] && [ "${ARMOR_SLURM_KEEP:-0}" != 1 ]; then
  bash slurm/ci/install_slurm.sh down || echo "test.sh: stopping the CI Slurm cluster failed" >&2
fi
exit "$rc"
