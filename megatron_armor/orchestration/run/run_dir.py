"""Opening a run directory before anything starts: lock, clean-up, resume decision, config.

:func:`open_run_dir` runs before Ray and the actors start, in this order:

1. take the run's lock (:class:`~megatron_armor.orchestration.run.run_lock.RunLock`; a second
   run on the directory is refused);
2. delete ``checkpoints/.tmp-*`` left by interrupted saves;
3. decide where to resume from (``--resume auto|none|PATH``; the newest complete checkpoint
   whose ``orchestrator.pt`` the safe loader accepts), refused when it holds a model of
   another shape than ``trainer.model_path`` or optimizer state that does not load at the
   configured parallel layout (``resume_check.py``); a layout change is said on the console
   (the trainer reshards the checkpoint on load);
4. write ``config.yaml`` — on a fresh start only. A resumed run keeps the original and, once
   the resume has succeeded (:func:`announce_resume`, called by the session after the restore),
   appends the settings it changed to ``resumes.jsonl`` (``{"step", "time", "changed": {key:
   [old, new]}}``, and ``"layout": {"from", "to"}`` for a parallel layout change), so ``config.yaml`` always describes the run that made the checkpoints and a
   failed attempt leaves no record.

The config was validated by ``load_config`` before this runs, so a refused config never
touches the directory.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

from omegaconf import OmegaConf

from megatron_armor.config.loader import as_run, save_config
from megatron_armor.config.resume_layout import Layout, layout_change, read_saved_layout
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.orchestration.run import checkpoints
from megatron_armor.orchestration.run.resume_check import (
    METADATA,
    model_shape_problem,
    optimizer_layout_problem,
)
from megatron_armor.orchestration.run.run_lock import RunLock
from megatron_armor.orchestration.run.run_state import RunState

CONFIG_FILE = "config.yaml"
RESUMES_FILE = "resumes.jsonl"


def _flat(tree, prefix: str = "") -> dict:
    """``{"section.key": value}`` of a nested dict (lists are values)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved_yaml: Path, config: ArmorConfig) -> dict[str, list]:
    """Settings of ``config`` that differ from the run's ``config.yaml``: ``{key: [old, new]}``."""
    old = _flat(OmegaConf.to_container(OmegaConf.load(saved_yaml)))
    new = _flat(OmegaConf.to_container(as_run(config)))
    return {k: [old.get(k), v] for k, v in sorted(new.items()) if old.get(k) != v}


def resumed_layout_change(checkpoint: Path, config: ArmorConfig) -> dict[str, dict] | None:
    """``{"from", "to"}`` parallel layouts when ``config`` resumes ``checkpoint`` at another
    one (``config/resume_layout.py``); ``None``: the same, or a save that records none."""
    saved = read_saved_layout(checkpoint)
    return None if saved is None else layout_change(saved, config)


def record_resume(
    run_dir: Path, config: ArmorConfig, step: int, checkpoint: Path | None = None
) -> dict[str, list]:
    """Append the resumed run's changed settings to ``resumes.jsonl``, with the parallel
    layout's change as ``layout: {"from", "to"}`` when ``checkpoint`` was saved at another;
    returns the changed settings."""
    saved = run_dir / CONFIG_FILE
    if not saved.is_file():  # a checkpoint without the config of its run: record this one
        save_config(config, run_dir)
        return {}
    changed = config_changes(saved, config)
    record = {"step": step, "time": time.time(), "changed": changed}
    layout = resumed_layout_change(checkpoint, config) if checkpoint is not None else None
    if layout is not None:
        record["layout"] = layout
    with (run_dir / RESUMES_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")
    return changed


def decide_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to resume from (``None`` = fresh start); ``--resume none`` in a directory
    with checkpoints is refused (it would overwrite them)."""
    path = checkpoints.resolve_resume(run_dir, resume, RunState.load)
    existing = checkpoints.step_dirs(run_dir)
    if path is None and existing and resume == "none":
        raise checkpoints.CheckpointError(
            f"--resume none but {run_dir} already holds checkpoints up to step "
            f"{existing[-1][0]}; use --resume auto, or a new run.name / run.output_dir"
        )
    if path is None and existing:  # auto, and every checkpoint was skipped (reasons above)
        raise checkpoints.CheckpointError(
            f"--resume auto: none of the {len(existing)} checkpoints under "
            f"{checkpoints.checkpoint_root(run_dir)} can be resumed (see above); move them "
            "away to start over, or pass --resume PATH to a good copy"
        )
    return path


def require_same_model(config: ArmorConfig, run_dir: Path, path: Path, resume: str) -> None:
    """Refuse a resume whose checkpoint holds a model of another shape than
    ``trainer.model_path``, or optimizer state that does not load at the configured layout
    (``resume_check.py``), before anything starts; say so when it reshards."""
    try:
        problem = model_shape_problem(path, config.trainer.model_path)
    except pickle.UnpicklingError as e:
        raise checkpoints.CheckpointError(
            f"--resume {resume}: {path / METADATA} holds objects that are not checkpoint "
            f"metadata ({e}); it was not written by a run of this recipe (or was tampered "
            "with): resume from another checkpoint"
        ) from None
    if problem is None:
        layout = optimizer_layout_problem(path, config)
        if layout is not None:
            raise checkpoints.CheckpointError(f"--resume {resume}: {layout}")
        announce_layout_change(path, config)
        return
    saved = run_dir / CONFIG_FILE
    started = OmegaConf.load(saved).trainer.model_path if saved.is_file() else None
    hint = f" ({saved}: trainer.model_path={started})" if started else ""
    raise checkpoints.CheckpointError(
        f"--resume {resume}: {problem}; resume with the model the run started from{hint}, or "
        "start a new run with this model (another run.name)"
    )


def open_run_dir(config: ArmorConfig, run_dir: Path, resume: str) -> tuple[RunLock, Path | None]:
    """Lock ``run_dir``, clean it, decide the resume checkpoint (refused when it holds another
    model), write the config of a fresh start (see the module docstring); the lock is released
    again if any of it fails. A resume's changed settings are recorded once it succeeded
    (:func:`announce_resume`)."""
    lock = RunLock(run_dir).acquire()
    try:
        checkpoints.remove_stale_temps(run_dir)
        path = decide_resume(run_dir, resume)
        if path is None:
            save_config(config, run_dir)
        else:
            require_same_model(config, run_dir, path, resume)
    except BaseException:
        lock.release()
        raise
    return lock, path


def announce_layout_change(checkpoint: Path, config: ArmorConfig) -> None:
    """Say on the console, before anything starts, that the resume reshards ``checkpoint``."""
    change = resumed_layout_change(checkpoint, config)
    if change is not None:
        old, new = (Layout(**change[k]) for k in ("from", "to"))
        print(f"resume: {checkpoint.name} was saved at {old}; resharded on load to {new}",
              flush=True)  # fmt: skip


def announce_resume(
    run_dir: Path, config: ArmorConfig, step: int, checkpoint: Path | None = None
) -> None:
    """After a resume succeeded: :func:`record_resume`, and the changed settings on the
    console."""
    changed = record_resume(run_dir, config, step, checkpoint)
    if changed:
        print(f"resume: settings changed since the run started: {sorted(changed)} "
              f"(recorded in {run_dir / RESUMES_FILE})", flush=True)  # fmt: skip
