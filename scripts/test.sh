#!/usr/bin/env bash
# Set up everything the tests need, then run every test tier this machine supports.
# unit + dist + e2e always; slurm when Slurm can be installed (root + apt); sglang (the real
# SGLang server on CPU) in its own cached virtualenv (scripts/sglang_env.sh); gpu only with CUDA.
# The CI Slurm cluster (two namespace nodes) is stopped at the end unless ARMOR_SLURM_KEEP=1.
#
# With no argument the tiers run as two concurrent streams, since one tier alone keeps about
# one core of two busy (most of a tiny run is start-up and waiting on processes):
#   stream 1 (in front):  unit, dist, e2e          tests/ but tests/slurm
#   stream 2 (behind):    slurm, then sglang       tests/slurm; tests/sglang_tier tests/gpu
# Stream 2's output goes to logs/test-slurm.log and logs/test-sglang.log, printed when it ends;
# each stream's pytest also writes its tests' times and outcomes to logs/test-*.xml (JUnit).
# Extra arguments make one sequential pytest run of tiers 1-4 with them (e.g.
# `bash scripts/test.sh -m unit`); the sglang tier then runs after it only with
# ARMOR_SGLANG_TIER=1 (0: never; default: when no argument is given).
set -euo pipefail
cd "$(dirname "$0")/.."
sglang_tier=${ARMOR_SGLANG_TIER:-auto}
[ "$sglang_tier" != auto ] || { [ $# -eq 0 ] && sglang_tier=1 || sglang_tier=0; }
mkdir -p logs
rm -f logs/sglang_env.rc logs/test-*.log logs/test-*.xml logs/build-*.log
if [ "$sglang_tier" = 1 ]; then
  # its ~11 GB install (first run only) downloads while the tests run, at the lowest priority;
  # its exit status lands in logs/sglang_env.rc (stream 2, a subshell, cannot `wait` for it)
  { rc=0; nice -n 19 bash scripts/sglang_env.sh > logs/sglang_env.log 2>&1 || rc=$?
    echo "$rc" > logs/sglang_env.rc; } &
  sglang_env=$!
fi
bash scripts/bootstrap.sh
slurm_started=0
if bash slurm/ci/install_slurm.sh; then
  slurm_started=1
else
  echo "test.sh: Slurm could not be installed or started; the slurm tier will report it" >&2
fi
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

stop_slurm() {
  if [ "$slurm_started" = 1 ] && [ "${ARMOR_SLURM_KEEP:-0}" != 1 ]; then
    bash slurm/ci/install_slurm.sh down || echo "test.sh: stopping the CI Slurm cluster failed" >&2
  fi
}

sglang_tier() {  # the real SGLang server on CPU, in its own virtualenv
  local rc=0 sglang_py
  # until the install has written its status, or has ended without one (killed)
  while [ ! -s logs/sglang_env.rc ] && kill -0 "$sglang_env" 2>/dev/null; do sleep 5; done
  if [ "$(cat logs/sglang_env.rc 2>/dev/null)" = 0 ]; then
    sglang_py=$(tail -n 1 logs/sglang_env.log)
    # the checkout's code on the path (the cached venv serves every clone)
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$sglang_py" -m pytest --durations=15 \
      -p no:cacheprovider --junitxml=logs/test-sglang.xml -m sglang tests/sglang_tier tests/gpu \
      || rc=$?
  else
    echo "test.sh: the sglang tier's virtualenv could not be set up (logs/sglang_env.log):" >&2
    tail -n 30 logs/sglang_env.log >&2
    rc=1
  fi
  return "$rc"
}

if [ $# -gt 0 ]; then
  rc=0
  .venv/bin/python -m pytest --durations=15 "$@" || rc=$?
  stop_slurm
  if [ "$sglang_tier" = 1 ]; then
    sglang_tier || rc=1
  fi
  exit "$rc"
fi

# The tiny artifacts, both built at once as the streams start (one core each, ~1 min); a test
# that needs one waits on its lock (tests/e2e/e2e_runs.py, tiny_artifacts).
for name in tiny tiny_moe; do
  .venv/bin/python -c "import sys; sys.path.insert(0, 'tests/e2e')
from e2e_runs import tiny_artifacts; tiny_artifacts(moe='$name' == 'tiny_moe')" \
    > "logs/build-$name.log" 2>&1 &
done

stream2() {
  local rc=0
  # own pytest temp roots: neither stream's clean-up of old temp dirs meets the other's
  PYTEST_DEBUG_TEMPROOT=$(mktemp -d /tmp/armor-tests-slurm.XXXX) \
    .venv/bin/python -m pytest --durations=15 -p no:cacheprovider tests/slurm \
    --junitxml=logs/test-slurm.xml > logs/test-slurm.log 2>&1 || rc=$?
  stop_slurm >> logs/test-slurm.log 2>&1
  if [ "$sglang_tier" = 1 ]; then
    PYTEST_DEBUG_TEMPROOT=$(mktemp -d /tmp/armor-tests-sglang.XXXX) \
      sglang_tier > logs/test-sglang.log 2>&1 || rc=1
  fi
  return "$rc"
}
stream2 &
stream2_pid=$!
rc=0
.venv/bin/python -m pytest --durations=15 --junitxml=logs/test-unit-dist-e2e.xml \
  --ignore=tests/slurm || rc=$?
wait "$stream2_pid" || rc=1
for log in logs/test-slurm.log logs/test-sglang.log; do
  [ -f "$log" ] || continue
  printf '\n==================== %s ====================\n' "$log"
  cat "$log"
done
exit "$rc"
