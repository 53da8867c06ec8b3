"""Slurm tier: the stop signals as Slurm sends them, on one job that is requeued three times.

1. ``scancel --signal=TERM --full`` while the driver starts up (every process of the job gets
   SIGTERM): the driver stops before its first step (exit 75), the job requeues itself.
2. ``scancel --signal=TERM --full`` while step 2 runs: Ray's processes block the signal
   (``orchestration/ray_node.py``), so the driver finishes the step, checkpoints it, exits 75,
   and the job requeues itself.
3. A preemption while step 3 runs, as ``PreemptMode=REQUEUE`` does it: ``scontrol requeue``
   sends SIGTERM to every process of the job, SIGKILL after ``KillWait``, and requeues it.

The last start resumes and completes, and every step's metrics equal those of an uninterrupted
job run at the same time. Each signal waits on the driver's log or the step's anchor file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_sbatch import (  # noqa: E402
    JOB_TIMEOUT_S,
    _job_field,
    _job_report,
    _submit,
    _wait_done,
    _wait_until,
    cluster,  # noqa: F401 - fixtures shared with test_sbatch.py
    tiny_dir,  # noqa: F401
    workdir,  # noqa: F401
)

pytestmark = pytest.mark.slurm

STEPS = 4
OVERRIDES = [f"run.steps={STEPS}", "run.ckpt_every=100"]
VOLATILE = ("timing/", "perf/", "wall_time", "reward/verify_seconds")  # wall-clock dependent


def stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def since_restart(driver_log: Path, restart: int) -> str:
    """The driver log of start ``restart`` of the job ('' before it began)."""
    text = driver_log.read_text() if driver_log.is_file() else ""
    marker = f"=== restart {restart} "
    return text.split(marker, 1)[1] if marker in text else ""


def running_until(job_id: str, predicate):
    """``predicate``, failing at once if the job ended before it came true."""

    def check() -> bool:
        if predicate():
            return True
        state = _job_field(job_id, "JobState")
        assert state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), f"job {state}"
        return False

    return check


def test_signals_requeue_the_job_and_it_resumes_exactly(workdir, tmp_path):  # noqa: F811
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    (reference_dir / "artifacts").symlink_to(workdir / "artifacts")
    ref_id, ref_job_dir = _submit(reference_dir, OVERRIDES)
    job_id, job_dir = _submit(workdir, OVERRIDES)
    driver, anchors = job_dir / "driver.log", workdir / "runs" / "tiny_cpu" / "anchors"
    report = lambda: _job_report(workdir, job_id, job_dir)  # noqa: E731
    full_term = ["scancel", "--signal=TERM", "--full", job_id]
    try:
        started = running_until(job_id, lambda: "armor train: starting" in since_restart(driver, 0))
        _wait_until(started, JOB_TIMEOUT_S, "the driver's start-up", report)
        subprocess.run(full_term, check=True, timeout=30)
        step_2 = running_until(job_id, (anchors / "step_000002.jsonl").is_file)
        _wait_until(step_2, JOB_TIMEOUT_S, "step 2", report)
        subprocess.run(full_term, check=True, timeout=30)
        step_3 = running_until(job_id, (anchors / "step_000003.jsonl").is_file)
        _wait_until(step_3, JOB_TIMEOUT_S, "step 3", report)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        state = _wait_done(job_id, workdir, job_dir)
        ref_state = _wait_done(ref_id, reference_dir, ref_job_dir)
    finally:
        subprocess.run(["scancel", job_id, ref_id], timeout=30)
    out = report()
    assert ref_state == "COMPLETED", _job_report(reference_dir, ref_id, ref_job_dir)
    assert state == "COMPLETED" and int(_job_field(job_id, "Restarts")) >= 3, out
    assert "SIGTERM before the next step: no step run; newest checkpoint: none" in since_restart(
        driver, 0
    ), out
    assert "SIGTERM: checkpoint of step 2 written" in since_restart(driver, 1), out
    assert "resumed from" in since_restart(driver, 3), out
    assert f"step {STEPS}/{STEPS}" in since_restart(driver, 3), out
    expected = {r["step"]: stable(r) for r in read_metrics(reference_dir / "runs" / "tiny_cpu")}
    got = {r["step"]: stable(r) for r in read_metrics(workdir / "runs" / "tiny_cpu")}
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1)), out  # no validation
    for step in range(1, STEPS + 1):
        assert got[step] == expected[step], step
