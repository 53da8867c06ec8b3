"""A short training run and its throughput page: the first dated figure of a machine in
NeMo-RL's definition (docs/profiling.md).

``armor train configs/tiny_cpu.yaml`` for a few steps, then ``armor report`` on its run
directory (``RUN_DIR/report/report.md``: where each step's time went, tokens/s/GPU, the
planner's prediction beside it). ``--gpu`` trains on this node's first GPU (``colocated``, the
embedded engine beside one trainer rank); the first-contact script runs it so
(``benchmarks/gpu_first_contact.py``, check ``throughput_report``). Without ``--gpu`` it runs
the CPU layout, as the quick start does. The tiny model (0.4M parameters, ``armor tiny``, built
when missing) makes the figure a figure of the pipeline, not of a model: it compares in
definition with the peers' rows, not in size.

    python benchmarks/throughput_run.py [--gpu] [--steps 4] [--out runs/throughput_run] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
ON_ONE_GPU = ("orchestration.layout=colocated", "orchestration.nodes=1",
              "orchestration.gpus_per_node=1", "trainer.world_size=1")  # fmt: skip
"""The tiny config on one GPU: one trainer rank and the embedded engine share it."""
REHEARSAL = ("algo.group_size=4", "algo.ref_n=2", "rollout.batch=4", "rollout.gen_batch=8",
             "trainer.ppo_mini_batch=2", "validation.n_samples=2", "validation.max_problems=8")  # fmt: skip
"""Smaller batches for the first contact's rehearsal on CPU (one step, the same code path)."""


def run_overrides(out: Path, steps: int, gpu: bool, tiny: Path) -> list[str]:
    """``armor train`` overrides of the run: ``steps`` steps into ``out/throughput``, a
    validation and a checkpoint at the last step only, the tiny artifacts at ``tiny``."""
    return [
        f"run.output_dir={out}", "run.name=throughput", f"run.steps={steps}",
        f"run.ckpt_every={steps}", f"validation.every={steps}", "validation.max_problems=16",
        "logging.progress=false", f"trainer.model_path={tiny / 'model'}",
        f"data.train_files=[{tiny / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tiny / 'data' / 'val.parquet'}]", *(ON_ONE_GPU if gpu else ()),
    ]  # fmt: skip


def armor(*args: str, deadline: float) -> subprocess.CompletedProcess:
    """``armor ARGS`` in a subprocess, stopped at ``deadline`` (``time.monotonic()``)."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    left = max(1.0, deadline - time.monotonic())
    return subprocess.run([sys.executable, "-m", "megatron_armor.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=left)  # fmt: skip


def tiny_artifacts(deadline: float) -> Path:
    """``$ARMOR_TINY_DIR`` or ``artifacts/tiny``, built by ``armor tiny`` when incomplete."""
    from megatron_armor.tiny.build import MARKER

    tiny = Path(os.environ.get("ARMOR_TINY_DIR", REPO / "artifacts" / "tiny"))
    if not (tiny / MARKER).is_file():
        done = armor("tiny", "--out", str(tiny), deadline=deadline)
        if done.returncode:
            raise RuntimeError(f"armor tiny failed: {done.stderr[-2000:]}")
    return tiny


def train_and_report(out: Path, steps: int, gpu: bool, timeout_s: float, extra=()) -> dict:
    """The run and its page within ``timeout_s``; the figures the page leads with (see the
    module docstring)."""
    from megatron_armor.observability.metrics import read_metrics

    deadline = time.monotonic() + timeout_s
    tiny = tiny_artifacts(deadline)
    args = [*run_overrides(out, steps, gpu, tiny), *extra]
    done = armor("train", str(CONFIG), *args, "--resume", "none", "--no-summary",
                 deadline=deadline)  # fmt: skip
    run_dir = out / "throughput"
    if done.returncode:
        raise RuntimeError(f"armor train exit {done.returncode}: {done.stdout[-3000:]}")
    report = armor("report", str(run_dir), deadline=deadline)
    if report.returncode:
        raise RuntimeError(f"armor report exit {report.returncode}: {report.stderr[-2000:]}")
    steps_run = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    per_gpu = [r["perf/e2e_tokens_per_s_per_gpu"] for r in steps_run]
    return {"run_dir": str(run_dir), "report": str(run_dir / "report" / "report.md"),
            "steps": len(steps_run), "step_s_mean": sum(r["timing/step_s"] for r in steps_run) / len(steps_run),
            "e2e_tokens_per_s_per_gpu_mean": sum(per_gpu) / len(per_gpu)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="train on this node's first GPU")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="runs/throughput_run")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args, extra = p.parse_known_args(argv)
    result = train_and_report(Path(args.out).resolve(), args.steps, args.gpu, args.timeout_s, extra)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
