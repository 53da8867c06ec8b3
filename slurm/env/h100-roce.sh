# H100 nodes with RoCE (RDMA over Converged Ethernet; 8 GPUs, 8 NICs): the InfiniBand preset
# (slurm/env/h100-ib.sh: the project's container through pyxis/enroot, NCCL's own defaults)
# plus the RoCE v2 GID index, which RoCE needs and native InfiniBand does not (3 on most
# Mellanox/NVIDIA NICs: `show_gids` lists them). Adjust the site's values in h100-ib.sh's
# variables or the environment (docs/slurm.md).
# ARMOR_ROOT: the repository (set by the sbatch files; when this file is sourced alone, its own)
export ARMOR_ROOT=${ARMOR_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/h100-ib.sh"
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}
