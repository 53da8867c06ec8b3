#!/usr/bin/env bash
# Start one Ray node in the foreground (`ray start --block`), run by srun on each node:
#   ray_node.sh head                 (first node; listens on ARMOR_RAY_PORT)
#   ray_node.sh worker HEAD_IP:PORT  (other nodes)
# SIGUSR2 to this process (srun forwards it) stops the Ray processes it started, and only those;
# SIGTERM, SIGINT and SIGUSR1 do not reach Ray (the driver checkpoints on them).
set -euo pipefail
ARMOR_ROOT=${ARMOR_ROOT:?ARMOR_ROOT must point at the repository}
source "$ARMOR_ROOT/slurm/lib/common.sh"

role=${1:?usage: ray_node.sh head|worker [HEAD_IP:PORT]}
node=${SLURMD_NODENAME:-$(hostname -s)}
ip=$(node_ip)
args=(
  --block --disable-usage-stats
  --node-ip-address="$ip"
  --num-cpus="${ARMOR_RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-$(nproc)}}"
  # A resource named after the Slurm node lets the join check name a missing node exactly.
  --resources="{\"armor_node_${node}\": 1}"
  --temp-dir="$(ray_temp_dir "$node")"
)
[ -z "${ARMOR_RAY_NUM_GPUS:-}" ] || args+=(--num-gpus="$ARMOR_RAY_NUM_GPUS")
[ -z "${ARMOR_RAY_OBJECT_STORE_MB:-}" ] || args+=(--object-store-memory=$((ARMOR_RAY_OBJECT_STORE_MB * 1024 * 1024)))
case "$role" in
  head)
    args+=(--head --port="${ARMOR_RAY_PORT:-6379}")
    if [ "${ARMOR_RAY_DASHBOARD:-0}" = 1 ]; then
      args+=(--include-dashboard=true --dashboard-host=0.0.0.0 --dashboard-port="${ARMOR_RAY_DASHBOARD_PORT:-8265}")
    else
      args+=(--include-dashboard=false)
    fi ;;
  worker)
    args+=(--address="${2:?worker needs HEAD_IP:PORT}") ;;
  *) die "ray_node.sh: role must be head or worker, got '$role'" ;;
esac
log "ray start ($role) on $node at $ip"
# The stop signals (TERM, INT, USR1) are blocked in every Ray process (orchestration/actors/ray_node.py): Slurm sends
# them to all of the job's processes, and only the driver must act on them. SIGUSR2 stops Ray.
exec "${ARMOR_PYTHON:-python3}" -m megatron_armor.orchestration.actors.ray_node -- "${ARMOR_RAY:-ray}" start "${args[@]}"
