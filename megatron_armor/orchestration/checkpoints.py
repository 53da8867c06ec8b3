"""Atomic, rotating run checkpoints: ``run_dir/checkpoints/step_XXXXXX``.

A checkpoint is written into ``.tmp-step_XXXXXX`` and renamed when complete (a rename is
atomic on POSIX file systems), so a kill during a save never leaves a partial directory that
``--resume auto`` would pick up. Layout of one checkpoint::

    step_000010/
      trainer/             model, optimizer, scheduler, reference weights, trainer RNG
      orchestrator.pt      RunState: step, sampler, RNG, reset schedule, anchor cache, versions
      meta.json            step and wall time (human-readable)

``run.keep_best`` adds ``checkpoints/best.json`` (``{"step", "metric", "value", "mode"}``): the
checkpoint it names is kept outside the ``keep_last`` rotation until a better one replaces it.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{6,})$")
BEST_FILE = "best.json"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, path)``, oldest first (temp dirs are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / "meta.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or ``None``."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """Map ``--resume auto|none|PATH`` to a checkpoint directory (or ``None`` = fresh start)."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(
            f"--resume {resume}: not a complete checkpoint directory (no meta.json); "
            f"use --resume auto to pick the newest under {checkpoint_root(run_dir)}"
        )
    return path


def begin_checkpoint(run_dir: str | Path, step: int) -> Path:
    """A fresh, empty temp directory to write the checkpoint of ``step`` into."""
    tmp = checkpoint_root(run_dir) / f".tmp-{step_dir_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from a save that was killed
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(run_dir: str | Path, tmp: Path, step: int, keep_last: int) -> Path:
    """Mark ``tmp`` complete, rename it to ``step_XXXXXX`` and delete all but the newest ``keep_last``."""
    (tmp / "meta.json").write_text(json.dumps({"step": step, "time": time.time()}))
    final = checkpoint_root(run_dir) / step_dir_name(step)
    if final.exists():  # same step saved twice (e.g. periodic + signal): keep the newest
        shutil.rmtree(final)
    tmp.rename(final)
    kept = protected_steps(run_dir)
    for old_step, old in list_checkpoints(run_dir)[: -max(keep_last, 1)]:
        if old_step not in kept:
            shutil.rmtree(old, ignore_errors=True)
    return final


# --- keep-best (``run.keep_best``) ----------------------------------------------------------


def write_best(run_dir: str | Path, record: dict | None) -> None:
    """Atomically set (or with ``None`` remove) the run's best-checkpoint record."""
    path = checkpoint_root(run_dir) / BEST_FILE
    if record is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def read_best(run_dir: str | Path) -> dict | None:
    """The best-checkpoint record, or ``None`` when the run keeps none."""
    path = checkpoint_root(run_dir) / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def protected_steps(run_dir: str | Path) -> set[int]:
    """Steps the rotation must not delete (the best checkpoint)."""
    best = read_best(run_dir)
    return {int(best["step"])} if best else set()


def named_checkpoint(run_dir: str | Path, name: str) -> Path:
    """``best`` | ``latest`` | a step number -> that complete checkpoint of the run."""
    if name == "best":
        best = read_best(run_dir)
        if best is None:
            raise FileNotFoundError(
                f"{run_dir} has no {checkpoint_root(run_dir) / BEST_FILE}; the run needs "
                "run.keep_best.metric set (or name `latest` or a step)"
            )
        path = checkpoint_root(run_dir) / step_dir_name(int(best["step"]))
    elif name == "latest":
        path = latest_checkpoint(run_dir)
    elif name.isdigit():
        path = checkpoint_root(run_dir) / step_dir_name(int(name))
    else:
        raise ValueError(f"checkpoint name {name!r}: use best, latest or a step number")
    if path is None or not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint {name!r} ({path})")
    return path
