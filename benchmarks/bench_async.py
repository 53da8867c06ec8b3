"""One-step-off asynchronous rollout against the synchronous loop: whole ``armor train``
processes of the same config, interleaved, on this machine.

Each pair runs ``armor train CONFIG`` once with ``orchestration.async_rollout=off`` and once with
``one_step`` (the order alternates from pair to pair, so a drift of the machine's speed hits
both alike), each in its own output directory, with the same seed and settings. Per run:

- ``steps/hour`` and ``generated tokens/s`` over the training loop: the steps' summed
  ``timing/step_s`` (validation, checkpoints and weight pushes included; Ray and model start-up
  not) and the summed ``rollout/generated_tokens`` (policy + reference);
- the whole process's wall seconds (start-up included);
- where a step's time goes: mean ``timing/{rollout,logprobs,train,sync,validate,checkpoint}_s``
  and, for ``one_step``, ``async/overlap_fraction``, ``async/rollout_wait_s`` (the trainer
  waiting for a rollout) and ``async/trainer_wait_s`` (a finished rollout waiting for the
  updates).

Printed: each pair's ratios ``one_step / off`` and their median. Measure on a quiet machine
(nothing else running: a SGLang server beside it polls a core).

    python benchmarks/bench_async.py [--pairs 3] [--steps 30] [--config configs/tiny_cpu.yaml] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

REPO = Path(__file__).resolve().parents[1]
MODES = ("off", "one_step")
PHASES = ("rollout", "logprobs", "train", "sync", "validate", "checkpoint")
ASYNC_KEYS = ("async/overlap_fraction", "async/rollout_wait_s", "async/trainer_wait_s")


def run_once(config: str, mode: str, steps: int, out: Path, extra: list[str]) -> dict:
    """One ``armor train`` process; its loop and process timings from ``metrics.jsonl``."""
    name = f"{mode}_{time.time_ns()}"
    cmd = [sys.executable, "-m", "megatron_armor.cli", "train", config, f"run.steps={steps}",
           f"run.output_dir={out}", f"run.name={name}", f"orchestration.async_rollout={mode}",
           "logging.progress=false", "logging.tensorboard=false", *extra, "--no-summary"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    lines = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in lines if r["step"] >= 1]
    loop_s = sum(r["timing/step_s"] for r in steps_)
    tokens = sum(r.get("rollout/generated_tokens", 0.0) for r in steps_)
    out_ = {"mode": mode, "wall_s": wall, "loop_s": loop_s, "steps": len(steps_),
            "steps_per_hour": len(steps_) / loop_s * 3600, "tokens_per_s": tokens / loop_s,
            "tokens": tokens, "validate_total_s": sum(r.get("timing/validate_s", 0.0) for r in steps_),
            "lines": steps_}  # fmt: skip
    for phase in PHASES:
        out_[phase] = mean(r.get(f"timing/{phase}_s", 0.0) for r in steps_)
    for key in ASYNC_KEYS:
        values = [r[key] for r in steps_ if key in r]
        out_[key] = mean(values) if values else float("nan")
    return out_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.yaml"))
    parser.add_argument("overrides", nargs="*", help="key=value settings for both modes")
    args = parser.parse_args()
    print(f"bench_async: {args.config} run.steps={args.steps} {' '.join(args.overrides)}; "
          f"{args.pairs} pairs, {os.cpu_count()} cores", flush=True)  # fmt: skip
    pairs = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for i in range(args.pairs):
            order = MODES if i % 2 == 0 else MODES[::-1]
            got = {m: run_once(args.config, m, args.steps, Path(tmp), args.overrides)
                   for m in order}  # fmt: skip
            pairs.append(got)
            for m in order:
                r = got[m]
                phases = " ".join(f"{p} {r[p]:.2f}" for p in PHASES)
                extra = ""
                if m == "one_step":
                    extra = (f" | overlap {r['async/overlap_fraction']:.2f} rollout_wait "
                             f"{r['async/rollout_wait_s']:.2f} trainer_wait "
                             f"{r['async/trainer_wait_s']:.2f}")  # fmt: skip
                print(f"pair {i + 1} {m:8s}: {r['steps_per_hour']:7.0f} steps/h "
                      f"{r['tokens_per_s']:7.0f} tok/s loop {r['loop_s']:6.1f} s process "
                      f"{r['wall_s']:6.1f} s | s/step: {phases}{extra}", flush=True)  # fmt: skip
    print("\nratio one_step / off, per pair (median):")
    for key, label in (("steps_per_hour", "steps/hour"), ("tokens_per_s", "generated tokens/s")):
        ratios = [p["one_step"][key] / p["off"][key] for p in pairs]
        print(f"  {label:20s} " + " ".join(f"{x:.3f}" for x in ratios)
              + f"  (median {median(ratios):.3f})")  # fmt: skip
    ratios = [p["off"]["wall_s"] / p["one_step"]["wall_s"] for p in pairs]
    print(f"  {'process speed-up':20s} " + " ".join(f"{x:.3f}" for x in ratios)
          + f"  (median {median(ratios):.3f}; start-up included)")  # fmt: skip


if __name__ == "__main__":
    main()
