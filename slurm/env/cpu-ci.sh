# CPU cluster of slurm/ci/install_slurm.sh (two namespace nodes, or one): the repository's
# .venv, no containers, Ray with per-job token auth and no dashboard, a per-job Ray port and a
# small object store, short bring-up deadlines.
# ARMOR_ROOT: the repository (set by the sbatch files; when this file is sourced alone, its own)
export ARMOR_ROOT=${ARMOR_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
export ARMOR_LAUNCHER=none
export ARMOR_PYTHON=${ARMOR_PYTHON:-$ARMOR_ROOT/.venv/bin/python}
export ARMOR_RAY=${ARMOR_RAY:-$ARMOR_ROOT/.venv/bin/ray}
export PATH="$ARMOR_ROOT/.venv/bin:$PATH"
export ARMOR_RAY_PORT=${ARMOR_RAY_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export ARMOR_RAY_OBJECT_STORE_MB=${ARMOR_RAY_OBJECT_STORE_MB:-256}
export ARMOR_RAY_NUM_GPUS=0
export ARMOR_RAY_JOIN_TIMEOUT_S=${ARMOR_RAY_JOIN_TIMEOUT_S:-120}
export ARMOR_RAY_STOP_GRACE_S=${ARMOR_RAY_STOP_GRACE_S:-15}
export ARMOR_DRIVER_STOP_GRACE_S=${ARMOR_DRIVER_STOP_GRACE_S:-10}
export ARMOR_RAY_DASHBOARD=0
export RAY_AUTH_MODE=token   # the token armor.sbatch writes into the job dir
export RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
