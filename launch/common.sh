# Shared helpers for the launch/ scripts (sourced). Processes are tracked by PID, never by name.
ARMOR_ROOT=${ARMOR_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
ARMOR_PYTHON=${ARMOR_PYTHON:-$( [ -x "$ARMOR_ROOT/.venv/bin/python" ] && echo "$ARMOR_ROOT/.venv/bin/python" || echo python3)}
ARMOR_RAY=${ARMOR_RAY:-$(dirname "$ARMOR_PYTHON")/ray}
[ -x "$ARMOR_RAY" ] || ARMOR_RAY=ray

log() { echo "[armor-launch $(date +%H:%M:%S)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

free_port() {
  "$ARMOR_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

driver_words() {
  # DRIVER=(the training command): ARMOR_DRIVER (word-split) or `python -m megatron_armor.cli train`.
  # shellcheck disable=SC2206
  DRIVER=(${ARMOR_DRIVER:-$ARMOR_PYTHON -m megatron_armor.cli train})
}
