#!/usr/bin/env bash
# Submit `armor train` to a running Ray cluster as a Ray job (needs the cluster's dashboard,
# e.g. launch/local.sh with ARMOR_RAY_DASHBOARD=1 ARMOR_KEEP_RAY=1, or a head started with
# --include-dashboard=true).
#
#   launch/submit_job.sh [--no-wait] CONFIG [key=value ...]
#
# Settings (environment):
#   RAY_DASHBOARD_ADDRESS  job server URL (default http://127.0.0.1:8265)
#   ARMOR_JOB_ID           submission id (default armor-<date>-<pid>)
#   ARMOR_WORKING_DIR      upload this directory as the job's working_dir (default: none; the
#                          repository is expected at the same path on the head, e.g. a shared FS)
set -euo pipefail
source "$(dirname "$0")/common.sh"

WAIT=()
if [ "${1:-}" = "--no-wait" ]; then WAIT=(--no-wait); shift; fi
[ $# -ge 1 ] || die "usage: launch/submit_job.sh [--no-wait] CONFIG [key=value ...]"
ADDRESS=${RAY_DASHBOARD_ADDRESS:-http://127.0.0.1:8265}
JOB_ID=${ARMOR_JOB_ID:-armor-$(date +%Y%m%d-%H%M%S)-$$}

"$ARMOR_PYTHON" - "$ADDRESS" <<'PY' || die "no Ray job server at $ADDRESS: start the head with the dashboard (ARMOR_RAY_DASHBOARD=1 launch/local.sh, or ray start --include-dashboard=true) or set RAY_DASHBOARD_ADDRESS"
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/api/version", timeout=10).read()
PY

driver_words
# The entrypoint is one shell string run on the head: cd to the repository, then the driver.
entry="cd $(printf '%q' "$ARMOR_ROOT") && exec $(printf '%q ' "${DRIVER[@]}" "$@")"
args=(job submit --address="$ADDRESS" --submission-id="$JOB_ID" "${WAIT[@]}")
[ -z "${ARMOR_WORKING_DIR:-}" ] || args+=(--working-dir="$ARMOR_WORKING_DIR")
log "submitting $JOB_ID to $ADDRESS: $entry"
# ray quotes each entrypoint word; one `bash -c` keeps the cd and the driver together.
exec "$ARMOR_RAY" "${args[@]}" -- bash -c "$entry"
