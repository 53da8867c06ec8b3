# Generic cluster: software on the host (module/conda env already active at submit time),
# Ray token auth on, NCCL picks interfaces itself. Copy this file to make a cluster preset.
# ARMOR_ROOT: the repository (set by the sbatch files; when this file is sourced alone, its own)
export ARMOR_ROOT=${ARMOR_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
export ARMOR_LAUNCHER=${ARMOR_LAUNCHER:-none}          # none | pyxis | apptainer
export ARMOR_PYTHON=${ARMOR_PYTHON:-python3}           # the Python with megatron_armor installed
export ARMOR_RAY=${ARMOR_RAY:-ray}                     # the ray CLI of that environment
export ARMOR_RAY_PORT=${ARMOR_RAY_PORT:-6379}
export ARMOR_RAY_JOIN_TIMEOUT_S=${ARMOR_RAY_JOIN_TIMEOUT_S:-300}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}           # per-job token written by armor.sbatch
export RAY_USAGE_STATS_ENABLED=0
