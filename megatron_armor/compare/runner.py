"""Run a comparison: each ``(variant, seed)`` is an independent, resumable ``armor train`` run.

Locally the runs go one after another (seed-major: every variant of a seed, then the next
seed) in child processes (``armor train ... --resume auto``):
a finished run (a checkpoint of its last step) is skipped, an interrupted one resumes from its
newest checkpoint. A SIGTERM/SIGINT to ``armor compare`` is passed to the running child, which
checkpoints and exits 75; the comparison then stops (rerun it to continue). On Slurm the
unfinished runs become one array job (``slurm/compare_array.sbatch``), task ``i`` = run ``i``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from megatron_armor.compare.spec import CompareSpec, RunSpec, run_config, run_status

EXIT_REQUEUE = 75


def pending_runs(spec: CompareSpec) -> list[tuple[int, RunSpec, str]]:
    """``(array index, run, status)`` of every run that is not done, in spec order."""
    out = []
    for index, run in enumerate(spec.runs):
        status = run_status(run, run_config(run).run.steps)
        if status != "done":
            out.append((index, run, status))
    return out


def seed_major(spec: CompareSpec, run: RunSpec) -> tuple[int, int]:
    """Local order: every variant of the first seed, then of the next (early partial results
    already compare all variants)."""
    return spec.seeds.index(run.seed), spec.variants.index(run.variant)


def train_command(run: RunSpec) -> list[str]:
    return [sys.executable, "-m", "megatron_armor.cli", "train", *run.train_args(),
            "--resume", "auto", "--no-summary"]  # fmt: skip


class _Forward:
    """Pass SIGTERM/SIGINT to the running child; remember that one arrived."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.received: int | None = None

    def __call__(self, signum, _frame) -> None:
        self.received = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)


def run_one(run: RunSpec, forward: _Forward) -> int:
    """One ``armor train`` child, output appended to ``<variant>/seed_<seed>.log``."""
    log_path = run.run_dir.parent / f"{run.run_dir.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        log.write(f"=== armor compare: {shlex.join(train_command(run))}\n")
        log.flush()
        forward.child = subprocess.Popen(train_command(run), stdout=log, stderr=subprocess.STDOUT)
        code = forward.child.wait()
    forward.child = None
    return code


def run_local(spec: CompareSpec, echo=print) -> int:
    """Run every unfinished run in order; 0 when all are done, else the failing exit code."""
    forward = _Forward()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for _, run, status in sorted(pending_runs(spec), key=lambda p: seed_major(spec, p[1])):
            echo(f"armor compare: {run.label}: {'resuming' if status == 'partial' else 'starting'}")
            code = run_one(run, forward)
            if forward.received is not None:
                echo(f"armor compare: stopped by signal {forward.received} during {run.label} "
                     f"(exit {code}); rerun to resume")  # fmt: skip
                return EXIT_REQUEUE
            if code != 0:
                log = run.run_dir.parent / f"{run.run_dir.name}.log"
                echo(f"armor compare: {run.label} failed with exit code {code}; see {log}")
                return code
            echo(f"armor compare: {run.label}: done")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def write_task_args(spec: CompareSpec, indices: list[int]) -> Path:
    """``<run root>/slurm_tasks/<i>.args``: run ``i``'s ``armor train`` arguments, one a line."""
    out = spec.root / "slurm_tasks"
    out.mkdir(parents=True, exist_ok=True)
    for i in indices:
        (out / f"{i}.args").write_text("\n".join(spec.runs[i].train_args()) + "\n")
    return out


def slurm_command(
    spec: CompareSpec, sbatch_args: list[str], max_parallel: int = 0
) -> list[str] | None:
    """``sbatch --array=<unfinished indices>[%max_parallel] ... slurm/compare_array.sbatch
    ARGS_DIR`` with the task arguments written; ``None`` when every run is done.
    ``max_parallel`` (> 0): Slurm runs at most that many tasks of the array at once."""
    indices = [i for i, _, _ in pending_runs(spec)]
    if not indices:
        return None
    args_dir = write_task_args(spec, indices).resolve()
    script = Path(os.environ.get("ARMOR_ROOT", ".")) / "slurm" / "compare_array.sbatch"
    array = ",".join(map(str, indices)) + (f"%{max_parallel}" if max_parallel > 0 else "")
    return ["sbatch", f"--array={array}", f"--job-name=cmp-{spec.name}",
            *sbatch_args, str(script), str(args_dir)]  # fmt: skip
