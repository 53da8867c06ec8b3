"""``armor status RUN_DIR``: step, ETA, throughput, last validation, warnings, checkpoints.

Reads the run directory's files only (``metrics.jsonl``, ``config.yaml``, ``checkpoints/``):
no Ray, no GPU, no lock, so it runs on a login node next to a job that is writing them
(observability/status.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="where a run stands: step, ETA, validation, warnings")
    p.add_argument("run_dir", help="run directory (RUN.output_dir/RUN.name)")
    p.set_defaults(run=run)


def planned_steps(run_dir: Path) -> int:
    """``run.steps`` of the run's ``config.yaml`` (the resolved config it started with)."""
    from omegaconf import OmegaConf

    from megatron_armor.orchestration.run.run_dir import CONFIG_FILE

    return int(OmegaConf.load(run_dir / CONFIG_FILE).run.steps)


def saved_checkpoints(run_dir: Path) -> list[str]:
    """Checkpoint directories whose save finished (manifest written), oldest first; the files
    are not hashed (a 7B checkpoint would take minutes)."""
    from megatron_armor.orchestration.run.checkpoints import MANIFEST, step_dirs

    return [str(path) for _, path in step_dirs(run_dir) if (path / MANIFEST).is_file()]


def run(args: argparse.Namespace) -> int:
    from megatron_armor.observability.metrics import WANDB_ID_FILE, read_metrics
    from megatron_armor.observability.status import status_lines
    from megatron_armor.orchestration.run.checkpoints import read_best
    from megatron_armor.orchestration.run.run_dir import CONFIG_FILE

    run_dir = Path(args.run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        print(
            f"armor status: {run_dir}: no {CONFIG_FILE}; not a run directory (yet)", file=sys.stderr
        )
        return 2
    records = read_metrics(run_dir)
    lines = status_lines(
        records, planned_steps(run_dir), saved_checkpoints(run_dir), read_best(run_dir)
    )
    wandb_id = run_dir / WANDB_ID_FILE
    if wandb_id.is_file():
        lines.append(f"W&B run id: {wandb_id.read_text().strip()}")
    print(f"{run_dir}:")
    for line in lines:
        print(f"  {line}")
    return 0
