"""Free space for checkpoints: the check before every save, and a save that ran out of it.

Before a save the file system must hold :data:`SPACE_MARGIN` x the previous checkpoint's size
or, before the first checkpoint, x an estimate from the model (:func:`estimated_checkpoint_bytes`:
the policy and reference weights and the optimizer's state). When another writer fills the
disk during the save, the trainer's write fails with whatever its library says (torch's
``basic_ios::clear: iostream error`` names neither the path nor the errno): the save removes
its partial directory and :func:`no_space_error` turns the failure into a
:class:`DiskFullError` with the path, the bytes needed and free and the checkpoint a resume
continues from. ``armor train`` exits :data:`EXIT_NO_SPACE` on it (never requeued: the disk is
as full after a requeue). docs/troubleshooting.md lists both messages.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from megatron_armor.orchestration.run.checkpoints import (
    CheckpointError,
    checkpoint_root,
    directory_bytes,
    latest_checkpoint,
    step_dir_name,
)

SPACE_MARGIN = 1.1  # free space needed before a save: 1.1 x the checkpoint's expected size
EXIT_NO_SPACE = 74  # EX_IOERR
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class DiskFullError(CheckpointError):
    """The checkpoint's file system has no room for it; the message names the path, the bytes
    needed and free, and the checkpoint that is intact."""


def format_bytes(count: float) -> str:
    """``512 B``, ``7.4 MiB``, ``1.23 GiB``: the unit that keeps the number readable."""
    value, unit = float(count), _UNITS[0]
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.3g} {unit}"


def estimated_checkpoint_bytes(model_path: str, precision: str) -> int:
    """The size of a checkpoint of the model at ``model_path``: policy and reference weights
    in ``precision`` and Adam's state (fp32 moments, and fp32 master weights below fp32);
    0 when its ``config.json`` gives no dimensions."""
    from megatron_armor.planner.memory import param_bytes
    from megatron_armor.planner.model import load_model_dims

    try:
        params = load_model_dims(model_path).total_params()
    except (OSError, ValueError, KeyError):
        return 0
    adam = 8 if precision == "fp32" else 12
    return int(params * (2 * param_bytes(precision) + adam))


def space_needed(run_dir: str | Path, estimate: int) -> tuple[int, str]:
    """``(bytes, why)`` a new checkpoint needs: the previous one's size, or ``estimate``
    before the first (0: unknown), with the margin."""
    previous = latest_checkpoint(run_dir)
    if previous is not None:
        size = directory_bytes(previous)
        return int(size * SPACE_MARGIN), f"{previous.name} is {format_bytes(size)}"
    return int(estimate * SPACE_MARGIN), f"the model's checkpoint is about {format_bytes(estimate)}"


def check_free_space(run_dir: str | Path, step: int, estimate: int = 0) -> int:
    """Raise :class:`DiskFullError` when the checkpoints' file system cannot hold the
    checkpoint of ``step`` (:func:`space_needed`); returns the bytes needed."""
    need, why = space_needed(run_dir, estimate)
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < need:
        kept = ("or lower run.keep_last (the existing checkpoints are intact)"
                if latest_checkpoint(run_dir) else "(no checkpoint of the run exists yet)")  # fmt: skip
        raise DiskFullError(
            f"not enough free space for the checkpoint of step {step}: about "
            f"{format_bytes(need)} needed ({why}), {format_bytes(free)} free under {root}; free "
            f"space there {kept}"
        )
    return need


def _ran_out(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it, also in a Ray actor) says the disk was full."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
    return False


def innermost(err: BaseException) -> str:
    """``Type: first line`` of the error that started ``err`` (through a Ray task's cause)."""
    while getattr(err, "cause", None) is not None or err.__cause__ is not None:
        err = getattr(err, "cause", None) or err.__cause__
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def no_space_error(
    run_dir: str | Path, step: int, tmp: Path, err: BaseException, need: int
) -> DiskFullError | None:
    """After the save of ``step`` into ``tmp`` failed with ``err``: remove ``tmp``; a
    :class:`DiskFullError` when the disk was full (``err`` says so, or the free space left is
    under ``need``), else ``None`` (another failure: raise ``err``)."""
    shutil.rmtree(tmp, ignore_errors=True)
    root = checkpoint_root(run_dir)
    free = shutil.disk_usage(root).free
    if not _ran_out(err) and free >= need:
        return None
    previous = latest_checkpoint(run_dir)
    kept = (f"the previous checkpoint {previous} is intact; `--resume auto` continues from it"
            if previous else "there is no earlier checkpoint; a new start begins at step 0")  # fmt: skip
    fix = "free space there or lower run.keep_last" if previous else "free space there"
    return DiskFullError(
        f"no space left while writing the checkpoint of step {step} to "
        f"{root / step_dir_name(step)} ({innermost(err)}): about "
        f"{format_bytes(need)} needed, {format_bytes(free)} free under {root}; the partial "
        f"checkpoint was removed and {kept}; {fix}"
    )


def full_disk_error(run_dir: str | Path, err: BaseException) -> DiskFullError | None:
    """A write of the run outside a checkpoint (the anchor files, ``metrics.jsonl``,
    TensorBoard) that met a full disk, as a :class:`DiskFullError` naming the file, the free
    bytes and what a resume keeps; ``None`` when ``err`` is no full disk."""
    if not _ran_out(err):
        return None
    path = next((getattr(e, "filename", None) for e in _chain(err) if getattr(e, "filename", None)),
                None) or run_dir  # fmt: skip
    where = Path(path).parent
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    previous = latest_checkpoint(run_dir)
    kept = (f"the newest checkpoint {previous} is intact; free space there, then "
            "`--resume auto` continues from it (the steps after it are trained again)"
            if previous else "no checkpoint of the run exists yet: free space there and start "
            "again (set run.ckpt_every lower to keep trained steps)")  # fmt: skip
    return DiskFullError(
        f"no space left on the device while writing {path} ({innermost(err)}): "
        f"{format_bytes(free)} free under {where}; {kept}"
    )


def _chain(err: BaseException):
    """``err`` and what caused it (also in a Ray actor)."""
    seen: BaseException | None = err
    for _ in range(16):
        if seen is None:
            return
        yield seen
        seen = getattr(seen, "cause", None) or seen.__cause__ or seen.__context__
