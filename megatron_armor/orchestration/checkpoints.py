"""Atomic, rotating run checkpoints: ``run_dir/checkpoints/step_XXXXXX``.

A checkpoint is written into ``.tmp-step_XXXXXX`` and renamed when complete (a rename is
atomic on POSIX file systems), so a kill during a save never leaves a partial directory that
``--resume auto`` would pick up. Layout of one checkpoint::

    step_000010/
      trainer/             model, optimizer, scheduler, reference weights, trainer RNG
      orchestrator.pt      RunState: step, sampler, RNG, reset schedule, anchor cache, versions
      meta.json            step and wall time (human-readable)
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{6,})$")


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
    for _, old in list_checkpoints(run_dir)[: -max(keep_last, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final
