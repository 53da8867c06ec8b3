#!/usr/bin/env bash
# Set up everything the tests need, then run every test tier this machine supports.
# unit + dist + e2e always; slurm when Slurm can be installed (root + apt); sglang (the real
# SGLang server on CPU) in its own cached virtualenv (scripts/sglang_env.sh); gpu only with CUDA.
# The CI Slurm cluster (two namespace nodes) is stopped at the end unless ARMOR_SLURM_KEEP=1.
# Extra arguments go to the first pytest run (tiers 1-4, e.g. `bash scripts/test.sh -m unit`);
# the sglang tier runs when no argument is given, or with ARMOR_SGLANG_TIER=1 (0: never).
set -euo pipefail
cd "$(dirname "$0")/.."
sglang_tier=${ARMOR_SGLANG_TIER:-auto}
[ "$sglang_tier" != auto ] || { [ $# -eq 0 ] && sglang_tier=1 || sglang_tier=0; }
mkdir -p logs
if [ "$sglang_tier" = 1 ]; then
  # its ~11 GB install (first run only) downloads while tiers 1-4 run, at the lowest priority
  nice -n 19 bash scripts/sglang_env.sh > logs/sglang_env.log 2>&1 &
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
rc=0
.venv/bin/python -m pytest --durations=15 "$@" || rc=$?
if [ "$slurm_started" = 1 ] && [ "${ARMOR_SLURM_KEEP:-0}" != 1 ]; then
  bash slurm/ci/install_slurm.sh down || echo "test.sh: stopping the CI Slurm cluster failed" >&2
fi
if [ "$sglang_tier" = 1 ]; then
  if wait "$sglang_env"; then
    sglang_py=$(tail -n 1 logs/sglang_env.log)
    # the checkout's code on the path (the cached venv serves every clone)
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$sglang_py" -m pytest --durations=15 \
      -m sglang tests/sglang_tier tests/gpu || rc=$?
  else
    echo "test.sh: the sglang tier's virtualenv could not be set up (logs/sglang_env.log):" >&2
    tail -n 30 logs/sglang_env.log >&2
    rc=1
  fi
fi
exit "$rc"
