#!/usr/bin/env bash
# The main job on a fresh CPU machine: set up .venv, build the warm-started tiny model and its
# arithmetic task (once), then train ARMOR end to end through Ray (real megatron-core actor,
# embedded engine, rewards, anchors, reference resets, validation). Ends with the run's
# summary table and where its plots are. Extra arguments go to `armor train` as overrides,
# e.g. `bash scripts/quickstart.sh run.steps=4`.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/bootstrap.sh
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TINY=${ARMOR_TINY_DIR:-artifacts/tiny}
if [ ! -f "$TINY/model/config.json" ] || [ ! -f "$TINY/data/val.parquet" ]; then
  .venv/bin/armor tiny --out "$TINY"
fi
.venv/bin/armor train configs/tiny_cpu.yaml "$@"
run_dir=$(.venv/bin/armor config show configs/tiny_cpu.yaml "$@" \
  | .venv/bin/python -c 'import sys, yaml; r = yaml.safe_load(sys.stdin)["run"]; print(r["output_dir"] + "/" + r["name"])')
echo
echo "quickstart finished in $(( $(date +%s) - start ))s"
echo "run directory: $run_dir (metrics.jsonl, tb/, anchors/, checkpoints/, summary.txt)"
echo "plots:         $run_dir/plots/*.png   (re-draw with: .venv/bin/armor plot $run_dir)"
