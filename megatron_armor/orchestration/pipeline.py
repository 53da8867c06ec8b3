"""``armor pipeline``: the paper's two-stage protocol as one resumable job.

arXiv 2607.10481 §3 and §5.1: train the baseline (DAPO) until validation degrades while the
training reward keeps rising (over-optimization), take the best checkpoint before the decline,
and continue from it with ARMOR (or a KL-regularized baseline) with that checkpoint as the
policy and as the reference. The stages::

    stage1   `train` of stage 1's config until its detector fires (run/run_watch.py) or run.steps
    export   its best checkpoint (run.keep_best) -> OUTPUT_DIR/NAME/stage1_best_hf (HF format)
    stage2   `train` of stage 2's config from stage1_best_hf: own run dir, step counter from 0,
             fresh optimizer (Adam moments and LR warm-up start over, see docs/orchestration.md)
    done

``OUTPUT_DIR/NAME/pipeline.json`` records the stage reached (written atomically after each
transition). Every stage is idempotent given that file: a run killed anywhere — inside a stage
(the stage resumes from its newest checkpoint), between stages (the export is redone into a
temporary directory and renamed) — continues where it was when started again, e.g. by a Slurm
requeue; exit 75 from a stage (SIGTERM/SIGUSR1 checkpoint) is passed on for the requeue.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from megatron_armor.config.loader import save_config
from megatron_armor.config.pipeline import Pipeline
from megatron_armor.orchestration.run import checkpoints

STATE_FILE = "pipeline.json"
SOURCE_FILE = "source.json"  # in stage 2's run dir: where its start checkpoint came from


def read_state(root: Path) -> dict:
    path = root / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {"stage": "stage1"}


def write_state(root: Path, state: dict) -> None:
    """Atomically record the pipeline's progress."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps({**state, "time": time.time()}, indent=1))
    tmp.replace(root / STATE_FILE)


def stage_dir(config) -> Path:
    return Path(config.run.output_dir) / config.run.name


def run_stage(config, label: str) -> int:
    """Train (or resume, ``--resume auto``) one stage; summary and plots when it finishes."""
    from megatron_armor.orchestration.run.finish import finish
    from megatron_armor.orchestration.step.loop import train

    print(f"pipeline: {label} in {stage_dir(config)}", flush=True)
    code = train(config, "auto")
    if code == 0:
        finish(stage_dir(config))
    return code


def best_of_stage1(p: Pipeline) -> tuple[Path, dict]:
    """Stage 1's best checkpoint and its record (``checkpoints/best.json``)."""
    run_dir = stage_dir(p.stage1)
    record = checkpoints.read_best(run_dir)
    if record is None:
        raise FileNotFoundError(
            f"{run_dir}: stage 1 recorded no best checkpoint (no validation ran); set "
            "validation.every > 0 in its config"
        )
    return checkpoints.named_checkpoint(run_dir, "best"), record


def export_best(p: Pipeline) -> dict:
    """Stage 1's best checkpoint as an HF model in ``stage1_best_hf`` (via a temp dir)."""
    from megatron_armor.trainer.convert import convert_to_hf

    checkpoint, record = best_of_stage1(p)
    tmp = p.best_hf_dir.with_name(f".{p.best_hf_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_to_hf(str(checkpoint), p.stage1.trainer.model_path, str(tmp), "policy",
                  p.stage1.trainer.precision)  # fmt: skip
    shutil.rmtree(p.best_hf_dir, ignore_errors=True)
    tmp.rename(p.best_hf_dir)
    return {**record, "checkpoint": str(checkpoint), "hf_dir": str(p.best_hf_dir)}


def link_stage2(p: Pipeline, best: dict) -> None:
    """Stage 2's run dir names where it started: ``source.json`` and a ``stage1`` link."""
    run_dir = stage_dir(p.stage2)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SOURCE_FILE).write_text(json.dumps(best, indent=1))
    link = run_dir / "stage1"
    if not link.is_symlink():
        link.symlink_to(Path("..") / stage_dir(p.stage1).name)
    save_config(p.stage2, run_dir)


def stage1_outcome(p: Pipeline) -> str:
    """How stage 1 ended, from its last checkpoint: ``detector at step N`` or ``step limit``."""
    from megatron_armor.orchestration.run.run_state import RunState

    latest = checkpoints.latest_checkpoint(stage_dir(p.stage1))
    overopt = (RunState.load(latest).watch.get("overopt") or {}) if latest else {}
    fired = overopt.get("fired_step")
    return f"detector at step {fired}" if fired is not None else "step limit"


def run_pipeline(p: Pipeline) -> int:
    """Run (or continue) the pipeline; returns the exit code (0 done, 75 requeue, ...)."""
    state = read_state(p.root)
    if state["stage"] == "stage1":
        code = run_stage(p.stage1, "stage 1")
        if code != 0:
            return code
        state = {"stage": "export", "stage1_end": stage1_outcome(p)}
        write_state(p.root, state)
        print(f"pipeline: stage 1 finished ({state['stage1_end']}); exporting its best", flush=True)
    if state["stage"] == "export":
        best = export_best(p)
        link_stage2(p, best)
        state = {**state, "stage": "stage2", "best": best}
        write_state(p.root, state)
        print(f"pipeline: stage 2 starts from step {best['step']} of stage 1 "
              f"({best['metric']} = {best['value']:.4f})", flush=True)  # fmt: skip
    if state["stage"] == "stage2":
        code = run_stage(p.stage2, "stage 2")
        if code != 0:
            return code
        state = {**state, "stage": "done"}
        write_state(p.root, state)
    print(f"pipeline: done; {p.root / STATE_FILE}", flush=True)
    return 0
