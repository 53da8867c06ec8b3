#!/usr/bin/env bash
# Profile chosen training steps.
#
#   launch/profile.sh [--tool nsys|dlprof|torch] [--steps 3,4] [--capture cudaProfilerApi|nvtx]
#                     [--out DIR] CONFIG [key=value ...]
#
# nsys:   Nsight Systems around the driver (Ray started in-process, so every actor process is a
#         descendant and is followed); capture limited to the chosen steps by cudaProfilerStart/
#         Stop (default) or by the NVTX range `profile/step_<S>` (--capture nvtx); NVTX phase
#         ranges (rollout, log-probs, train, weight sync, reset) on. Report: DIR/armor.nsys-rep.
# dlprof: the DLProf tool (older NGC containers) in PyTorch mode, same step selection.
# torch:  torch.profiler Chrome traces of the chosen steps in DIR (no external tool).
# Every tool runs the config as a run of its own under DIR (run.output_dir): the real run's
# directory and checkpoints are never touched.
# Then `armor report RUN_DIR --gather DIR`: the reports copied into RUN_DIR/profile and the
# run's page RUN_DIR/report/report.md (docs/profiling.md), after a failed run too.
# ARMOR_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
source "$(dirname "$0")/common.sh"

TOOL=nsys STEPS=3 CAPTURE=cudaProfilerApi OUT=""

run_forwarding_signals() {
  # The run as a child ($rc: its exit code); SIGTERM, SIGINT and SIGUSR1 go on to it (the
  # driver checkpoints on them and exits 75), and the page below is written after it anyway.
  "$@" &
  local child=$! sig
  for sig in TERM INT USR1; do trap "kill -s $sig $child 2>/dev/null" "$sig"; done
  while :; do
    rc=0; wait "$child" || rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal ended the wait, not the run
  done
  trap - TERM INT USR1
}

report_into_run_dir() {
  # `armor report` of the run: its page and PNGs, with this capture's Nsight Systems reports
  # ($OUT) copied into RUN_DIR/profile beside the torch traces and the SGLang servers' reports.
  local run_dir
  run_dir=$("$ARMOR_PYTHON" -m megatron_armor.cli config show "$@" | "$ARMOR_PYTHON" -c \
    'import sys, yaml; r = yaml.safe_load(sys.stdin)["run"]; print(r["output_dir"] + "/" + r["name"])') \
    || { log "no run directory for $* (armor config show failed)"; return 0; }
  "$ARMOR_PYTHON" -m megatron_armor.cli report "$run_dir" --gather "$OUT" \
    || log "armor report $run_dir failed (see above); the profiles are in $OUT"
}
dry_run_or_have() { [ "${ARMOR_DRY_RUN:-0}" = 1 ] || command -v "$1" >/dev/null; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) TOOL=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --capture) CAPTURE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see the header of launch/profile.sh)" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || die "usage: launch/profile.sh [--tool nsys|dlprof|torch] [--steps 3,4] CONFIG [key=value ...]"
[[ "$STEPS" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--steps $STEPS: give step numbers like 3 or 3,4"
OUT=${OUT:-runs/profile-$TOOL-$(date +%Y%m%d-%H%M%S)}
driver_words
# the profiled run is its own (run.output_dir=OUT, from step 1): it never trains the real run,
# and its steps 1.. are the chosen ones' (a run resumed after them would capture nothing)
cmd=("${DRIVER[@]}" "$@" "logging.profile=$TOOL" "logging.profile_steps=[$STEPS]" "run.output_dir=$OUT")

case "$TOOL" in
  nsys)
    dry_run_or_have nsys || die "nsys (Nsight Systems) is not on PATH; NGC containers ship it, or install the Nsight Systems CLI"
    # repeat: every chosen step is its own range and report (stop would keep only the first)
    capture=(--capture-range=cudaProfilerApi --capture-range-end=repeat)
    if [ "$CAPTURE" = nvtx ]; then
      first=${STEPS%%,*}
      capture=(--capture-range=nvtx "--nvtx-capture=profile/step_${first}@armor" --capture-range-end=stop)
      export NSYS_NVTX_PROFILER_REGISTER_ONLY=0  # match our unregistered range names
    elif [ "$CAPTURE" != cudaProfilerApi ]; then
      die "--capture $CAPTURE: use cudaProfilerApi or nvtx"
    fi
    export ARMOR_NVTX=1
    cmd=(nsys profile --trace=cuda,nvtx,osrt,cublas,cudnn --sample=none --trace-fork-before-exec=true
         "${capture[@]}" --force-overwrite=true --output="$OUT/armor" "${cmd[@]}") ;;
  dlprof)
    dry_run_or_have dlprof || die "the DLProf tool is not installed (it ships only in older NGC PyTorch containers; PyPI's nvidia-dlprof is a placeholder); use --tool nsys"
    cmd=(dlprof --mode=pytorch --force=true --output_path="$OUT" "${cmd[@]}") ;;
  torch) ;;
  *) die "--tool $TOOL: use nsys, dlprof or torch" ;;
esac

log "profiling with $TOOL, steps $STEPS -> $OUT"
run_args=("$@" "run.output_dir=$OUT")  # the profiled run's own directory, under OUT
if [ "${ARMOR_DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
  echo "then: armor report <the run directory of ${run_args[*]}> --gather $OUT"
  exit 0
fi
mkdir -p "$OUT"
run_forwarding_signals "${cmd[@]}"
report_into_run_dir "${run_args[@]}"
exit "$rc"
