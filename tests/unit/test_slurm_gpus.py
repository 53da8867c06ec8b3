"""Unit tier: the Slurm steps of a GPU preset ask for their GPUs, and a job that holds none is
refused before Ray starts (``slurm/lib/common.sh``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def bash(script: str, **env: str) -> subprocess.CompletedProcess:
    source = f"ARMOR_ROOT={REPO}; source {REPO}/slurm/lib/common.sh; {script}"
    return subprocess.run(["bash", "-c", source], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})  # fmt: skip


def test_a_gpu_step_asks_for_the_nodes_gpus_and_every_other_step_for_none():
    words = ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1"]
    out = bash('set_srun_words n1 gpu; printf "%s\\n" "${SRUN[@]}"', ARMOR_RAY_NUM_GPUS="8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [*words, "--gres=gpu:8"]
    driver = bash('set_srun_words n1; printf "%s\\n" "${SRUN[@]}"', ARMOR_RAY_NUM_GPUS="8")
    assert driver.stdout.split() == [*words, "--gres=none"]
    cpu = bash('set_srun_words n1 gpu; printf "%s\\n" "${SRUN[@]}"', ARMOR_RAY_NUM_GPUS="0")
    assert "--gres" not in cpu.stdout


def test_a_job_without_its_gpus_is_refused_naming_the_sbatch_flag():
    refused = bash("check_job_gpus", ARMOR_RAY_NUM_GPUS="8")
    assert refused.returncode == 1
    assert "sbatch --gpus-per-node=8" in refused.stderr and "holds 0 GPU(s)" in refused.stderr
    assert bash("check_job_gpus", ARMOR_RAY_NUM_GPUS="8", SLURM_GPUS_ON_NODE="8").returncode == 0
    assert bash("check_job_gpus", ARMOR_RAY_NUM_GPUS="0").returncode == 0
