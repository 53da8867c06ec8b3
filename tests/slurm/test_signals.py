"""Slurm tier: the stop signals as Slurm sends them, on one job that is requeued three times.

1. ``scancel --signal=TERM --full`` while the driver starts up (every process of the job gets
   SIGTERM): the driver stops before its first step (exit 75), the job requeues itself.
2. ``scancel --signal=TERM --full`` once step 1 has ended: Ray's processes block the signal
   (``orchestration/actors/ray_node.py``), so the driver finishes the step, checkpoints it, exits 75,
   and the job requeues itself.
3. A preemption once the next start has run a step, as ``PreemptMode=REQUEUE`` does it: ``scontrol requeue``
   sends SIGTERM to every process of the job, SIGKILL after ``KillWait``, and requeues it.

The last start resumes and completes, and every step's metrics equal those of an uninterrupted
job run at the same time. Each signal waits on the driver's log or a step's anchor file (written
as the step ends; a tiny step takes about a second, so the checkpoint's step is read from the log).
"""

from __future__ import annotations

import re
import subprocess

import pytest
from slurm_jobs import FINAL_STATES, JOB_TIMEOUT_S, Job, make_workdir, wait_until

from megatron_armor.observability.metrics import read_metrics, without_wall_clock
from megatron_armor.orchestration.step.step_metrics import anchor_file_steps

pytestmark = pytest.mark.slurm

STEPS = 8  # steps of the tiny config take about a second: room for the signals mid-run
OVERRIDES = [f"run.steps={STEPS}", "run.ckpt_every=100"]
CHECKPOINTED = re.compile(r"SIGTERM: checkpoint of step (\d+) written")


def since_restart(job: Job, restart: int) -> str:
    """The driver log of start ``restart`` of the job ('' before it began)."""
    marker = f"=== restart {restart} "
    text = job.driver_log()
    return text.split(marker, 1)[1] if marker in text else ""


def running_until(job: Job, predicate):
    """``predicate``, failing at once if the job ended before it came true."""

    def check() -> bool:
        if predicate():
            return True
        state = job.field("JobState")
        assert state not in FINAL_STATES, f"job {state}"
        return False

    return check


def signal_when(job: Job, predicate, what: str, command: list[str]) -> None:
    """Wait (bounded) until ``predicate`` holds while the job runs, then run ``command``."""
    wait_until(running_until(job, predicate), JOB_TIMEOUT_S, what, job.report)
    subprocess.run(command, check=True, timeout=30)


def test_signals_requeue_the_job_and_it_resumes_exactly(cluster, tiny_dir, workdir, jobs, tmp_path):
    reference = jobs.submit(make_workdir(tiny_dir, tmp_path / "reference"), OVERRIDES)
    job = jobs.submit(workdir, OVERRIDES)
    # step N's anchor file is written as step N ends (gzipped once a later checkpoint covers it)
    wrote = lambda step: lambda: step in anchor_file_steps(job.run_dir)  # noqa: E731
    full_term = ["scancel", "--signal=TERM", "--full", job.job_id]
    starting = lambda: "armor train: starting" in since_restart(job, 0)  # noqa: E731
    signal_when(job, starting, "the driver's start-up", full_term)
    signal_when(job, wrote(1), "step 1", full_term)
    wait_until(
        lambda: CHECKPOINTED.search(since_restart(job, 1)), 120, "the checkpoint", job.report
    )
    saved = int(CHECKPOINTED.search(since_restart(job, 1)).group(1))
    resumed = wrote(saved + 1)
    signal_when(job, resumed, f"step {saved + 1}", ["scontrol", "requeue", job.job_id])
    state, ref_state = job.wait_done(), reference.wait_done()
    out = job.report()
    assert ref_state == "COMPLETED", reference.report()
    assert state == "COMPLETED" and int(job.field("Restarts")) >= 3, out
    started = since_restart(job, 0)
    assert "SIGTERM before the next step: no step run; newest checkpoint: none" in started, out
    assert 1 <= saved < STEPS - 1, out  # mid-run
    assert "resumed from" in since_restart(job, 3), out
    assert f"step {STEPS}/{STEPS}" in since_restart(job, 3), out
    expected = {r["step"]: without_wall_clock(r) for r in read_metrics(reference.run_dir)}
    got = {r["step"]: without_wall_clock(r) for r in read_metrics(job.run_dir)}
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1)), out  # no validation
    for step in range(1, STEPS + 1):
        assert got[step] == expected[step], step
