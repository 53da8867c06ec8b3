# Shared helpers for slurm/armor.sbatch and slurm/lib/ray_node.sh (sourced, not executed).
# Every process this job starts is tracked by PID; nothing is ever killed by name.

# Exit code `armor train` uses for "checkpoint written on a signal; requeue me".
ARMOR_REQUEUE_EXIT_CODE=${ARMOR_REQUEUE_EXIT_CODE:-75}

log() { echo "[armor-slurm $(date +%H:%M:%S) ${SLURMD_NODENAME:-$(hostname -s)}] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

load_env_preset() {
  # Source slurm/env/<name>.sh (cluster settings); an absent preset names the choices.
  local name=$1 file="$ARMOR_ROOT/slurm/env/$1.sh"
  if [ ! -f "$file" ]; then
    die "ARMOR_ENV=$name: no preset $file; choose one of: $(cd "$ARMOR_ROOT/slurm/env" && ls -- *.sh | sed 's/\.sh$//' | tr '\n' ' ')"
  fi
  # shellcheck disable=SC1090
  source "$file"
}

node_ip() {
  # This node's address for Ray: the IPv4 of ARMOR_NODE_IFACE when set (e.g. the IB or
  # high-speed Ethernet interface), else the first address `hostname -I` reports.
  local ip=""
  if [ -n "${ARMOR_NODE_IFACE:-}" ]; then
    ip=$(ip -4 -o addr show dev "$ARMOR_NODE_IFACE" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    [ -n "$ip" ] || die "ARMOR_NODE_IFACE=$ARMOR_NODE_IFACE has no IPv4 address on $(hostname -s); set it to an interface listed by 'ip -4 addr'"
  else
    ip=$(hostname -I 2>/dev/null | awk '{print $1}')
    [ -n "$ip" ] || ip=$(hostname -i | awk '{print $1}')
  fi
  echo "$ip"
}

set_container_words() {
  # CONTAINER=(words that run a command inside the job's container on this node): apptainer;
  # empty for none, and for pyxis, whose containers are entered through srun (set_srun_words).
  CONTAINER=()
  case "${ARMOR_LAUNCHER:-none}" in
    none|pyxis) ;;
    apptainer)
      [ -n "${ARMOR_CONTAINER_IMAGE:-}" ] || die "ARMOR_LAUNCHER=apptainer needs ARMOR_CONTAINER_IMAGE (a .sif file or docker:// URI)"
      # shellcheck disable=SC2206
      CONTAINER=(apptainer exec ${ARMOR_APPTAINER_ARGS:---nv})
      [ -z "${ARMOR_CONTAINER_MOUNTS:-}" ] || CONTAINER+=(--bind "$ARMOR_CONTAINER_MOUNTS")
      CONTAINER+=("$ARMOR_CONTAINER_IMAGE") ;;
    *) die "ARMOR_LAUNCHER=${ARMOR_LAUNCHER}: must be none, pyxis or apptainer" ;;
  esac
}

check_job_gpus() {
  # A preset with GPUs (ARMOR_RAY_NUM_GPUS > 0) needs a job that asked for them: Slurm gives a
  # job's steps only GPUs the job requested (--gpus-per-node / --gres), --exclusive alone none.
  local want=${ARMOR_RAY_NUM_GPUS:-0} have=${SLURM_GPUS_ON_NODE:-0}
  [ "$want" -gt 0 ] || return 0
  [ "$have" -ge "$want" ] || die "ARMOR_RAY_NUM_GPUS=$want but this job holds ${have} GPU(s) per node (SLURM_GPUS_ON_NODE); submit with sbatch --gpus-per-node=$want (or --gres=gpu:$want), or lower ARMOR_RAY_NUM_GPUS"
}

set_srun_words() {
  # SRUN=(srun one task on node $1, overlapping the job's other steps, inside the container).
  # Callers run "${SRUN[@]}" cmd ... as a simple command, so that $! is srun itself. With GPUs
  # (ARMOR_RAY_NUM_GPUS > 0) a Ray node's step ($2 = gpu) asks for them: an srun step gets the
  # GPUs it requests, not the job's, where the job's request did not reach its steps (e.g.
  # --gres given at submit). Every other step (driver, node wait, checks, profile gathering)
  # needs no GPU and asks for none (--gres=none, srun(1)): where GRES is not shared, a step
  # asking for the GPUs the Ray step holds would wait forever.
  SRUN=(srun --overlap --nodes=1 --ntasks=1 --nodelist="$1")
  if [ "${ARMOR_RAY_NUM_GPUS:-0}" -gt 0 ]; then
    if [ "${2:-}" = gpu ]; then SRUN+=(--gres="gpu:$ARMOR_RAY_NUM_GPUS"); else SRUN+=(--gres=none); fi
  fi
  if [ "${ARMOR_LAUNCHER:-none}" = pyxis ]; then
    [ -n "${ARMOR_CONTAINER_IMAGE:-}" ] || die "ARMOR_LAUNCHER=pyxis needs ARMOR_CONTAINER_IMAGE (a .sqsh file of docker/Dockerfile, see docs/gpu.md)"
    SRUN+=(--container-image="$ARMOR_CONTAINER_IMAGE" --container-workdir="$ARMOR_ROOT")
    [ -z "${ARMOR_CONTAINER_MOUNTS:-}" ] || SRUN+=(--container-mounts="$ARMOR_CONTAINER_MOUNTS")
    # shellcheck disable=SC2206
    SRUN+=(${ARMOR_PYXIS_ARGS:-})
  fi
  set_container_words
  SRUN+=("${CONTAINER[@]}")
}

ray_temp_dir() {
  # Ray's temp dir on node $1: per job and per node (nodes may share /tmp).
  echo "${ARMOR_RAY_TEMP_DIR:-/tmp/ray-armor-${SLURM_JOB_ID:-local}-$1}"
}

pid_running() {
  # Whether PID $1 exists and is not a zombie (an exited child not yet reaped).
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

stop_pids() {
  # SIGTERM the given PIDs (processes this job started), wait up to $1 seconds, then SIGKILL.
  local grace=$1; shift
  local pid alive deadline=$((SECONDS + grace))
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  while [ $SECONDS -lt $deadline ]; do
    alive=0
    for pid in "$@"; do pid_running "$pid" && alive=1; done
    [ $alive -eq 1 ] || return 0
    sleep 1
  done
  for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; done
}
