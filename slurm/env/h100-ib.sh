# H100 nodes with native InfiniBand (8 GPUs, 8 HCAs), the project's container (docker/Dockerfile: the
# pinned SGLang / torch / TE / megatron-core stack) through pyxis/enroot. Build it and import it
# once as a squashfs (docs/gpu.md):
#   docker build -f docker/Dockerfile -t megatron-armor:gpu . &&
#   enroot import -o $ARMOR_ROOT/megatron-armor-gpu.sqsh dockerd://megatron-armor:gpu
# Adjust the image, mounts, interface and HCA names to the site (see docs/slurm.md).
# ARMOR_ROOT: the repository (set by the sbatch files; when this file is sourced alone, its own)
export ARMOR_ROOT=${ARMOR_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
export ARMOR_LAUNCHER=${ARMOR_LAUNCHER:-pyxis}
export ARMOR_CONTAINER_IMAGE=${ARMOR_CONTAINER_IMAGE:-$ARMOR_ROOT/megatron-armor-gpu.sqsh}
export ARMOR_CONTAINER_MOUNTS=${ARMOR_CONTAINER_MOUNTS:-$ARMOR_ROOT:$ARMOR_ROOT}
export ARMOR_PYXIS_ARGS=${ARMOR_PYXIS_ARGS:---no-container-mount-home}
export ARMOR_PYTHON=${ARMOR_PYTHON:-python}
export ARMOR_RAY=${ARMOR_RAY:-ray}
export ARMOR_RAY_PORT=${ARMOR_RAY_PORT:-6379}
export ARMOR_RAY_NUM_GPUS=${ARMOR_RAY_NUM_GPUS:-8}
export ARMOR_RAY_JOIN_TIMEOUT_S=${ARMOR_RAY_JOIN_TIMEOUT_S:-600}
export ARMOR_NODE_IFACE=${ARMOR_NODE_IFACE:-}          # e.g. ib0 or the fast Ethernet NIC
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
export RAY_USAGE_STATS_ENABLED=0
# NCCL over native InfiniBand: HCAs by name prefix, socket bootstrap on the fast NIC; NCCL's
# own defaults otherwise (its GPUDirect RDMA level follows the PCI topology; no GID index, which
# only RoCE needs: slurm/env/h100-roce.sh).
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-${ARMOR_NODE_IFACE:-}}
[ -n "$GLOO_SOCKET_IFNAME" ] || unset GLOO_SOCKET_IFNAME
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron TP/SP overlap
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
