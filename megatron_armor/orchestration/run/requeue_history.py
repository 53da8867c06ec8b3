"""Every exit 75 of a run, and the end of a requeue loop (docs/orchestration.md, exit 70).

An exit 75 asks the scheduler for a requeue, and ``slurm/armor.sbatch`` requeues up to
``ARMOR_MAX_RESTARTS`` (50) times. A bad setting or a deterministic crash would meet the same
fault at the same step after every requeue: 50 restarts of a large job. So the ``armor``
process that runs the driver (``cli/supervise.py``) appends each exit 75 to
``RUN_DIR/requeues.jsonl`` (``{step, cause, signal, time, slurm_job, restart}``; ``cause``:
the fault's actor and error class, the driver's stall or the lost part of Ray, never a text
with times or pids) and counts the exits in a row at the same step with the same cause. The
``ARMOR_REQUEUE_REPEATS``-th (3 by default) exits :data:`EXIT_REQUEUE_LOOP` instead, naming
the cause: a code the sbatch file does not requeue. A stop signal (preemption, time limit)
is never a loop and ends a row of repeats, and so does a resume that changed settings
(``resumes.jsonl``): a new attempt counts from one.

Standard library only: the supervising parent reads it without importing the run's code.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HISTORY_FILE = "requeues.jsonl"
RESUMES_FILE = "resumes.jsonl"  # run_dir.py writes it: the settings a resume changed
EXIT_REQUEUE_LOOP = 70  # EX_SOFTWARE
DEFAULT_REPEATS = 3


def read_rows(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none when it is missing; a torn last line is skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def repeats(history: list[dict], resumes: list[dict]) -> int:
    """How many exits in a row, up to the last of ``history``, had its step and cause (0
    for a stop signal); a resume that changed settings after one of them starts a new row."""
    if not history or history[-1].get("signal"):
        return 0
    last = history[-1]
    changed = [r["time"] for r in resumes if r.get("changed")]
    since = max(changed, default=float("-inf"))
    count = 0
    for row in reversed(history):
        same = (row.get("step"), row.get("cause")) == (last["step"], last["cause"])
        if not same or row.get("signal") or row.get("time", 0) < since:
            break
        count += 1
    return count


def record_exit(run_dir: Path, step: int, cause: str, signalled: bool) -> int:
    """Append this exit 75 to ``RUN_DIR/requeues.jsonl``; returns :func:`repeats` with it."""
    row = {"step": step, "cause": cause, "signal": signalled, "time": time.time(),
           "slurm_job": os.environ.get("SLURM_JOB_ID"),
           "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}  # fmt: skip
    path = Path(run_dir) / HISTORY_FILE
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return repeats(read_rows(path), read_rows(Path(run_dir) / RESUMES_FILE))


def loop_message(run_dir: Path, step: int, cause: str, count: int, limit: int) -> str:
    """Why a run that asks for a requeue exits :data:`EXIT_REQUEUE_LOOP` instead."""
    return (f"exit 75 at step {step} for the {ordinal(count)} time in a row with the same "
            f"cause ({cause}): a requeue would meet it again, so exiting {EXIT_REQUEUE_LOOP}, "
            f"which slurm/armor.sbatch does not requeue (ARMOR_REQUEUE_REPEATS={limit}; the "
            f"exits: {Path(run_dir) / HISTORY_FILE}). Find the cause in the log above, fix it, "
            "then `armor train CONFIG --resume auto`")  # fmt: skip


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
