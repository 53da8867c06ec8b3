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
  # Callers run "${SRUN[@]}" cmd ... as a simple command, so that $! is the srun's keeper
  # (slurm/lib/detached_srun.py: srun runs outside the batch step's process tree, where no
  # preemption signal reaches it; srun would turn a SIGTERM into a SIGKILL of its step; the
  # keeper ignores SIGTERM/SIGINT, passes SIGUSR1/SIGUSR2 on and exits with srun's code). With
  # GPUs (ARMOR_RAY_NUM_GPUS > 0) a Ray node's step ($2 = gpu) asks for them: an srun step gets
  # the GPUs it requests, not the job's, where the job's request did not reach its steps (e.g.
  # --gres given at submit). Every other step (driver, node wait, checks, profile gathering)
  # needs no GPU and asks for none (--gres=none, srun(1)): where GRES is not shared, a step
  # asking for the GPUs the Ray step holds would wait forever.
  SRUN=(bash -c 'trap "" TERM INT; exec "$@"' detached "${ARMOR_HOST_PYTHON:-python3}"
    "$ARMOR_ROOT/slurm/lib/detached_srun.py" -- srun --overlap --nodes=1 --ntasks=1 --nodelist="$1")
  if [ "${ARMOR_RAY_NUM_GPUS:-0}" -gt 0 ]; then
    if [ "${2:-}" = gpu ]; then SRUN+=(--gres="gpu:$ARMOR_RAY_NUM_GPUS"); else SRUN+=(--gres=none); fi
  fi
  if [ "${ARMOR_LAUNCHER:-none}" = pyxis ]; then
    [ -n "${ARMOR_CONTAINER_IMAGE:-}" ] || die "ARMOR_LAUNCHER=pyxis needs ARMOR_CONTAINER_IMAGE (a .sqsh file of docker/Dockerfile, see docs/gpu.md)"
    # the working directory of the batch shell (the submit directory), as for ARMOR_LAUNCHER=none
    SRUN+=(--container-image="$ARMOR_CONTAINER_IMAGE" --container-workdir="$PWD")
    [ -z "${ARMOR_CONTAINER_MOUNTS:-}" ] || SRUN+=(--container-mounts="$ARMOR_CONTAINER_MOUNTS")
    # shellcheck disable=SC2206
    SRUN+=(${ARMOR_PYXIS_ARGS:-})
  fi
  set_container_words
  SRUN+=("${CONTAINER[@]}")
}

container_mount_targets() {
  # The paths ARMOR_CONTAINER_MOUNTS (SRC[:DST[:FLAGS]],...) makes visible in the container.
  local item src dst
  local -a items
  IFS=, read -ra items <<< "${ARMOR_CONTAINER_MOUNTS:-}"
  for item in "${items[@]}"; do
    [ -n "$item" ] || continue
    IFS=: read -r src dst _ <<< "$item"
    echo "${dst:-$src}"
  done
}

check_container_paths() {
  # pyxis: every step is its own container that sees only ARMOR_CONTAINER_MOUNTS, so the paths
  # the steps share (the repository, the submit directory, the job dir with the Ray token and
  # the logs) must lie under a mount; refused before anything starts, naming the path.
  [ "${ARMOR_LAUNCHER:-none}" = pyxis ] || return 0
  local path target under
  local -a targets
  mapfile -t targets < <(container_mount_targets)
  for path in "$@"; do
    under=""
    for target in "${targets[@]}"; do
      case "${path%/}/" in "${target%/}/"*) under=$target ;; esac
    done
    [ -n "$under" ] || die "ARMOR_LAUNCHER=pyxis: $path is not under ARMOR_CONTAINER_MOUNTS=${ARMOR_CONTAINER_MOUNTS:-} (each step is its own container and sees only those mounts); add $path:$path to ARMOR_CONTAINER_MOUNTS"
  done
}

ray_temp_dir() {
  # Ray's temp dir on node $1: per job and per node (nodes may share /tmp). pyxis gives every
  # step a private /tmp (enroot's tmpfs), so there it is on the node's /dev/shm, which enroot
  # shares with the host: the Ray node, the join check and the driver are separate containers
  # and reach the node's raylet through its sockets there.
  local root=/tmp
  [ "${ARMOR_LAUNCHER:-none}" != pyxis ] || root=/dev/shm
  echo "${ARMOR_RAY_TEMP_DIR:-$root/ray-armor-${SLURM_JOB_ID:-local}-$1}"
}

use_job_gpus() {
  # One-node jobs (convert, eval): the GPUs this job holds, whatever the preset's
  # ARMOR_RAY_NUM_GPUS (a training node's count); a GPU preset needs at least one.
  local have=${SLURM_GPUS_ON_NODE:-0}
  if [ "${ARMOR_RAY_NUM_GPUS:-0}" -gt 0 ] && [ "$have" -lt 1 ]; then
    die "this job holds no GPU (SLURM_GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-unset}) but the preset (ARMOR_ENV=${ARMOR_ENV:-default}) runs on GPUs; submit with sbatch --gpus-per-node=N"
  fi
  export ARMOR_RAY_NUM_GPUS=$have
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
