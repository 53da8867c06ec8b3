"""Unit tier: ``slurm/armor.sbatch`` signals itself ``ARMOR_SIGNAL_LEAD_S`` seconds before the
job's end time, and never when the job has less time than the lead (its functions, run by
bash with Slurm's end time in the environment)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def sbatch_functions(*names: str) -> str:
    """The bash text of the named functions of slurm/armor.sbatch."""
    text = (REPO / "slurm" / "armor.sbatch").read_text()
    return "\n".join(re.search(rf"^{n}\(\) {{\n.*?^}}\n", text, re.M | re.S)[0] for n in names)


def run_timer(seconds_left: str, wait_s: int) -> subprocess.CompletedProcess:
    script = f"""
log() {{ echo "$*" >&2; }}
{sbatch_functions("arm_time_limit_signal", "disarm_time_limit_signal")}
got=""; trap 'got=USR1' USR1
SLURM_JOB_ID=7 ARMOR_SIGNAL_LEAD_S=600
[ -z "{seconds_left}" ] || export SLURM_JOB_END_TIME=$(( $(date +%s) + {seconds_left or 0} ))
arm_time_limit_signal
for _ in $(seq {wait_s}); do [ -n "$got" ] && break; sleep 1; done
disarm_time_limit_signal
echo "got=$got"
"""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})  # fmt: skip


def test_the_job_signals_itself_the_lead_before_its_end():
    fired = run_timer("602", wait_s=8)
    assert "got=USR1" in fired.stdout, fired.stderr
    assert "time-limit signal (SIGUSR1) in 2 s, 600 s before the job's end" in fired.stderr


def test_no_signal_within_the_lead_or_without_an_end_time():
    short = run_timer("300", wait_s=1)  # nothing armed: nothing can come
    assert (
        "got=\n" in short.stdout and "ends in 300 s, within ARMOR_SIGNAL_LEAD_S=600" in short.stderr
    )
    unknown = run_timer("", wait_s=1)  # no SLURM_JOB_END_TIME, no squeue on PATH
    assert "got=\n" in unknown.stdout and "no end time known for job 7" in unknown.stderr
