# The CI cluster's containers (slurm/ci/install_slurm.sh: two CPU nodes; srun takes pyxis's
# --container-* flags through slurm/ci/pyxis_srun.py, each step an OCI container of Slurm's own
# support with enroot's isolation): the h100-ib preset itself (launcher pyxis, the repository
# mounted at its path, no home directory in the container, Ray token auth, Ray's temp dir on
# /dev/shm, the run lock without squeue) with no GPUs and no NCCL, the CPU image of this
# machine, and cpu-ci's small Ray and short deadlines. Make the image once:
#   bash slurm/ci/cpu_image.sh megatron-armor-cpu
# ARMOR_ROOT: the repository (set by the sbatch files; when this file is sourced alone, its own)
export ARMOR_ROOT=${ARMOR_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
export ARMOR_CONTAINER_IMAGE=${ARMOR_CONTAINER_IMAGE:-$ARMOR_ROOT/megatron-armor-cpu}
# the project's .venv, in the repository (mounted); its Python installation is in the image
export ARMOR_PYTHON=${ARMOR_PYTHON:-$ARMOR_ROOT/.venv/bin/python}
export ARMOR_RAY=${ARMOR_RAY:-$ARMOR_ROOT/.venv/bin/ray}
export PATH="$ARMOR_ROOT/.venv/bin:$PATH"
export ARMOR_RAY_NUM_GPUS=0
export ARMOR_RAY_PORT=${ARMOR_RAY_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
export ARMOR_RAY_OBJECT_STORE_MB=${ARMOR_RAY_OBJECT_STORE_MB:-256}
export ARMOR_RAY_JOIN_TIMEOUT_S=${ARMOR_RAY_JOIN_TIMEOUT_S:-120}
export ARMOR_RAY_STOP_GRACE_S=${ARMOR_RAY_STOP_GRACE_S:-15}
export ARMOR_DRIVER_STOP_GRACE_S=${ARMOR_DRIVER_STOP_GRACE_S:-10}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=false
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/h100-ib.sh"
# CPU nodes: gloo, no NCCL or CUDA settings
unset NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_DEBUG CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_AVOID_RECORD_STREAMS
