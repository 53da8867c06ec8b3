"""``armor pipeline PIPELINE [key=value ...]``: stage 1 until over-optimization, then stage 2
from its best checkpoint, as one resumable job (``orchestration/pipeline.py``).

Exit codes as ``armor train``: 0 done; 2 bad config; 75 a stage was interrupted by
SIGTERM/SIGUSR1 after a checkpoint — run the same command again (a Slurm requeue does) and the
pipeline continues where it was; 65 a stage diverged (``DivergedError``, not requeued).
"""

from __future__ import annotations

import argparse
import sys

from megatron_armor.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="stage 1 (e.g. DAPO) until over-optimization, then ARMOR")
    p.add_argument("config", help="pipeline YAML (configs/tiny_pipeline.yaml, configs/paper/)")
    p.add_argument("overrides", nargs="*",
                   help="name=/output_dir=, stage1.KEY=V / stage2.KEY=V, or KEY=V for both")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_armor.config.inputs import wandb_problems
    from megatron_armor.config.pipeline import load_pipeline

    try:
        pipeline = load_pipeline(args.config, args.overrides)
        missing = [p for c in (pipeline.stage1, pipeline.stage2) for p in wandb_problems(c)]
        if missing:  # before Ray starts, as `armor train` refuses it
            raise ConfigError(missing[0])
    except ConfigError as e:
        print(f"armor pipeline: {e}", file=sys.stderr)
        return 2
    from megatron_armor.cli.train_cmd import report_stop, stopping_errors
    from megatron_armor.orchestration.pipeline import run_pipeline
    from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE

    try:
        code = run_pipeline(pipeline)
    except stopping_errors() as e:
        return report_stop("armor pipeline", e)
    if code == EXIT_REQUEUE:
        print(f"armor pipeline: interrupted; continue with `armor pipeline {args.config}` "
              "(same overrides)")  # fmt: skip
    return code
