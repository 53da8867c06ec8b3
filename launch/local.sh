#!/usr/bin/env bash
# Single node, own Ray: start a Ray head for this run only, run `armor train` against it, stop it.
#
#   launch/local.sh CONFIG [key=value ...] [--resume auto]
#
# The head runs as `ray start --head --block` in the background, through
# megatron_armor/orchestration/actors/ray_node.py: SIGTERM/SIGINT/SIGUSR1 are blocked in its processes,
# so a signal to this script's whole process group reaches only the driver, which checkpoints and
# exits 75 (SIGINT/SIGTERM/SIGUSR1 to this script are forwarded to it). Stopping the head is a
# SIGUSR2 to that one PID, which stops exactly the Ray processes it started (other Ray clusters on
# the machine are left alone, unlike `ray stop`). Settings (environment):
#   ARMOR_RAY_PORT       GCS port (default: a free port)
#   ARMOR_RAY_DASHBOARD  1 = start the dashboard (needed by launch/submit_job.sh), default 0
#   ARMOR_RAY_DASHBOARD_PORT  default 8265
#   ARMOR_RAY_NUM_CPUS / ARMOR_RAY_NUM_GPUS   resources to advertise (default: detected)
#   ARMOR_LOG_DIR        where ray-head.log goes (default runs/launch-<pid>)
#   ARMOR_KEEP_RAY=1     leave the head running after the driver (prints how to stop it)
set -euo pipefail
source "$(dirname "$0")/common.sh"

[ $# -ge 1 ] || die "usage: launch/local.sh CONFIG [key=value ...]"
PORT=${ARMOR_RAY_PORT:-$(free_port)}
LOG_DIR=${ARMOR_LOG_DIR:-runs/launch-$$}
TEMP_DIR=${ARMOR_RAY_TEMP_DIR:-/tmp/ray-armor-$$}
mkdir -p "$LOG_DIR"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token} RAY_USAGE_STATS_ENABLED=0
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]; then
  # a token for this head only (mode 0600), read by the head and the driver
  export RAY_AUTH_TOKEN_PATH="$LOG_DIR/ray_auth_token"
  (umask 077; od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$RAY_AUTH_TOKEN_PATH")
fi
IP=$("$ARMOR_PYTHON" -c 'import ray._private.services as s; print(s.get_node_ip_address())')
RAY_PID="" DRIVER_PID="" GOT_SIGNAL=""

start_head() {
  local args=(start --head --block --port="$PORT" --node-ip-address="$IP" --temp-dir="$TEMP_DIR" --disable-usage-stats)
  if [ "${ARMOR_RAY_DASHBOARD:-0}" = 1 ]; then
    args+=(--include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="${ARMOR_RAY_DASHBOARD_PORT:-8265}")
  else
    args+=(--include-dashboard=false)
  fi
  [ -z "${ARMOR_RAY_NUM_CPUS:-}" ] || args+=(--num-cpus="$ARMOR_RAY_NUM_CPUS")
  [ -z "${ARMOR_RAY_NUM_GPUS:-}" ] || args+=(--num-gpus="$ARMOR_RAY_NUM_GPUS")
  "$ARMOR_PYTHON" -m megatron_armor.orchestration.actors.ray_node -- "$ARMOR_RAY" "${args[@]}" > "$LOG_DIR/ray-head.log" 2>&1 &
  RAY_PID=$!
  log "Ray head pid $RAY_PID at $IP:$PORT (log $LOG_DIR/ray-head.log)"
}

wait_head() {
  # The head is up when its GCS answers; bounded by ARMOR_RAY_START_TIMEOUT_S (default 120).
  local deadline=$((SECONDS + ${ARMOR_RAY_START_TIMEOUT_S:-120}))
  until "$ARMOR_RAY" status --address="$IP:$PORT" >/dev/null 2>&1; do
    kill -0 "$RAY_PID" 2>/dev/null || die "ray start exited; see $LOG_DIR/ray-head.log"
    [ $SECONDS -lt $deadline ] || die "Ray head not up after ${ARMOR_RAY_START_TIMEOUT_S:-120}s; see $LOG_DIR/ray-head.log"
    sleep 1
  done
}

stop_head() {
  [ -n "$RAY_PID" ] || return 0
  if [ "${ARMOR_KEEP_RAY:-0}" = 1 ]; then
    log "leaving Ray running: stop it with 'kill -USR2 $RAY_PID'"; return 0
  fi
  log "stopping Ray head (pid $RAY_PID)"
  kill -USR2 "$RAY_PID" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$RAY_PID" 2>/dev/null || { RAY_PID=""; return 0; }; sleep 1; done
  kill -KILL "$RAY_PID" 2>/dev/null || true
  RAY_PID=""
}

forward() {
  GOT_SIGNAL=$1
  [ -z "$DRIVER_PID" ] || kill -s "$1" "$DRIVER_PID" 2>/dev/null || true
}

main() {
  trap stop_head EXIT
  trap 'forward INT' INT
  trap 'forward TERM' TERM
  trap 'forward USR1' USR1
  start_head
  wait_head
  export RAY_ADDRESS="$IP:$PORT"
  driver_words
  # Overrides right after CONFIG, so that options the caller put last (--resume) stay last.
  "${DRIVER[@]}" "$1" "orchestration.ray_address=$RAY_ADDRESS" "${@:2}" &
  DRIVER_PID=$!
  local rc
  while true; do
    GOT_SIGNAL=""
    wait "$DRIVER_PID" && rc=0 || rc=$?
    [ -n "$GOT_SIGNAL" ] || break
  done
  log "driver exited $rc"
  exit "$rc"
}

main "$@"
