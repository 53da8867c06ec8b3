# Single-node CPU cluster of slurm/ci/install_slurm.sh: the repository's .venv, no containers,
# Ray without auth or dashboard, a per-job Ray port and a small object store.
export ARMOR_LAUNCHER=none
export ARMOR_PYTHON=${ARMOR_PYTHON:-$ARMOR_ROOT/.venv/bin/python}
export ARMOR_RAY=${ARMOR_RAY:-$ARMOR_ROOT/.venv/bin/ray}
export PATH="$ARMOR_ROOT/.venv/bin:$PATH"
export ARMOR_RAY_PORT=${ARMOR_RAY_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export ARMOR_RAY_OBJECT_STORE_MB=${ARMOR_RAY_OBJECT_STORE_MB:-256}
export ARMOR_RAY_NUM_GPUS=0
export ARMOR_RAY_JOIN_TIMEOUT_S=${ARMOR_RAY_JOIN_TIMEOUT_S:-120}
export ARMOR_RAY_DASHBOARD=0
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
