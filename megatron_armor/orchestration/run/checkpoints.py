"""Atomic, verified, rotating run checkpoints: ``run_dir/checkpoints/step_XXXXXX``.

A checkpoint is written into ``.tmp-step_XXXXXX``; its last file is ``manifest.json`` (every
file's size, and the SHA-256 of the small ones), then the directory is renamed into place (a
rename is atomic on POSIX file systems). Layout of one checkpoint::

    step_000010/
      trainer/             model, optimizer, scheduler, reference weights, trainer RNG
      orchestrator.pt      RunState: step, sampler, RNG, reset schedule, anchor cache, versions
      meta.json            step and wall time (human-readable)
      manifest.json        written last: {"step", "files": {relative path: {"size", "sha256"?}}}

``--resume auto`` takes the newest checkpoint whose manifest matches the files on disk and
whose ``orchestrator.pt`` loads with the safe loader; it prints why it skipped newer ones and
never deletes them. Rotation (:func:`rotate`) runs only after the new checkpoint is complete
and counts complete checkpoints only. See docs/orchestration.md ("Checkpoints").

``run.keep_best`` adds ``checkpoints/best.json`` (``{"step", "metric", "value", "mode"}``): the
checkpoint it names is kept outside the ``keep_last`` rotation until a better one replaces it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{6,})$")
BEST_FILE = "best.json"
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
CHECKSUM_MAX_BYTES = 16 * 1024**2  # files up to this size get a SHA-256 in the manifest


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed from; the message names the path and the fix."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``step_XXXXXX`` directory ``(step, path)``, complete or not, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _describe(path: Path) -> dict:
    size = path.stat().st_size
    entry: dict = {"size": size}
    if size <= CHECKSUM_MAX_BYTES:
        entry["sha256"] = _sha256(path)
    return entry


def write_manifest(checkpoint_dir: Path, step: int) -> Path:
    """Record every file of ``checkpoint_dir`` (size; SHA-256 when small). Written last."""
    files = {
        str(p.relative_to(checkpoint_dir)): _describe(p)
        for p in sorted(checkpoint_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    out = checkpoint_dir / MANIFEST
    out.write_text(json.dumps({"step": step, "files": files}, indent=1))
    return out


def manifest_problem(checkpoint_dir: Path) -> str | None:
    """Why ``checkpoint_dir`` is incomplete or damaged (``None`` when its manifest matches)."""
    try:
        files = json.loads((checkpoint_dir / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for name, entry in files.items():
        path = checkpoint_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, path)`` (manifest present and matching), oldest first."""
    return [(s, p) for s, p in step_dirs(run_dir) if manifest_problem(p) is None]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run, or ``None``."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


Loader = Callable[[Path], object]


def newest_loadable(run_dir: str | Path, load: Loader) -> Path | None:
    """The newest checkpoint that is complete and that ``load`` accepts; prints why it skipped
    each newer one (skipped directories are left on disk for inspection)."""
    for step, path in reversed(step_dirs(run_dir)):
        problem = manifest_problem(path)
        if problem is None:
            try:
                load(path)
                return path
            except Exception as e:  # noqa: BLE001 - any load failure means "try the older one"
                problem = f"cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0]})"
        print(f"resume: skipping {path} (step {step}): {problem}; left on disk", flush=True)
    return None


def resolve_resume(run_dir: str | Path, resume: str, load: Loader) -> Path | None:
    """Map ``--resume auto|none|PATH`` to a checkpoint directory (``None`` = fresh start).

    ``load`` is the orchestrator's state loader (``RunState.load``): a checkpoint it refuses
    is not resumable."""
    if resume == "none":
        return None
    if resume == "auto":
        return newest_loadable(run_dir, load)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"--resume {resume}: no such checkpoint directory; use --resume auto to pick the "
            f"newest complete one under {checkpoint_root(run_dir)}"
        )
    problem = manifest_problem(path)
    if problem is not None:
        raise CheckpointError(
            f"--resume {resume}: not a complete checkpoint: {problem}; use --resume auto to "
            f"pick the newest complete one under {checkpoint_root(run_dir)}"
        )
    load(path)
    return path


def remove_stale_temps(run_dir: str | Path) -> list[Path]:
    """Delete ``.tmp-*`` directories left by saves that were killed (call with the run lock held)."""
    root = checkpoint_root(run_dir)
    stale = sorted(p for p in root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        print(f"removed {path} (left by an interrupted save)", flush=True)
    return stale


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def begin_checkpoint(run_dir: str | Path, step: int) -> Path:
    """A fresh, empty temp directory to write the checkpoint of ``step`` into (the caller
    checked the free space first: ``disk_space.check_free_space``)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from a save that was killed
    tmp.mkdir()
    return tmp


def set_aside_or_replace(final: Path) -> None:
    """Make room for a new checkpoint of the same step: a complete one (the step saved twice,
    e.g. periodic + signal) is replaced; one that resume skipped is kept for inspection as
    ``step_XXXXXX.skipped-<time>`` (no longer a checkpoint name)."""
    if manifest_problem(final) is None:
        shutil.rmtree(final)
    else:
        final.rename(final.with_name(f"{final.name}.skipped-{int(time.time())}"))


def rotate(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, sparing the best one
    (:func:`protected_steps`); returns what it deleted. Incomplete directories are neither
    counted nor deleted."""
    kept = protected_steps(run_dir)
    older = list_checkpoints(run_dir)[: -max(keep_last, 1)]
    doomed = [path for step, path in older if step not in kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def commit_checkpoint(run_dir: str | Path, tmp: Path, step: int, keep_last: int) -> Path:
    """Mark ``tmp`` complete (meta, then the manifest), rename it to ``step_XXXXXX``, then
    :func:`rotate`."""
    (tmp / "meta.json").write_text(json.dumps({"step": step, "time": time.time()}))
    write_manifest(tmp, step)
    final = checkpoint_root(run_dir) / step_dir_name(step)
    if final.exists():
        set_aside_or_replace(final)
    tmp.rename(final)
    rotate(run_dir, keep_last)
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
