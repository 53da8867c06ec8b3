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


def srun_words(script: str, **env: str) -> list[str]:
    """The srun command of ``SRUN`` (after its keeper, ``slurm/lib/detached_srun.py --``)."""
    out = bash(f'{script}; printf "%s\\n" "${{SRUN[@]}}"', **env)
    assert out.returncode == 0, out.stderr
    words = out.stdout.splitlines()
    assert words[:2] == ["bash", "-c"] and "detached_srun.py" in words[5], words
    return words[words.index("--") + 1 :]


def test_a_gpu_step_asks_for_the_nodes_gpus_and_every_other_step_for_none():
    words = ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1"]
    assert srun_words("set_srun_words n1 gpu", ARMOR_RAY_NUM_GPUS="8") == [*words, "--gres=gpu:8"]
    assert srun_words("set_srun_words n1", ARMOR_RAY_NUM_GPUS="8") == [*words, "--gres=none"]
    assert "--gres=gpu:8" not in srun_words("set_srun_words n1 gpu", ARMOR_RAY_NUM_GPUS="0")


def test_one_node_jobs_use_the_gpus_they_hold_and_a_gpu_preset_needs_one():
    """convert.sbatch / eval.sbatch: `--gpus-per-node=1` under h100-ib (8 for training)."""
    one = bash('use_job_gpus; echo "$ARMOR_RAY_NUM_GPUS"', ARMOR_RAY_NUM_GPUS="8",
               SLURM_GPUS_ON_NODE="1")  # fmt: skip
    assert one.returncode == 0 and one.stdout.strip() == "1", one.stderr
    none = bash("use_job_gpus", ARMOR_RAY_NUM_GPUS="8")
    assert none.returncode == 1 and "submit with sbatch --gpus-per-node=N" in none.stderr
    cpu = bash('use_job_gpus; echo "$ARMOR_RAY_NUM_GPUS"', ARMOR_RAY_NUM_GPUS="0")
    assert cpu.returncode == 0 and cpu.stdout.strip() == "0"


def test_pyxis_steps_see_the_shared_paths_and_ray_on_dev_shm():
    """pyxis: each step a container; the paths steps share must be mounted, Ray's sockets live
    where every container of the node sees them."""
    pyxis = {
        "ARMOR_LAUNCHER": "pyxis",
        "SLURM_JOB_ID": "7",
        "ARMOR_CONTAINER_MOUNTS": "/repo:/repo",
    }
    assert bash("ray_temp_dir n1", **pyxis).stdout.strip() == "/dev/shm/ray-armor-7-n1"
    assert bash("ray_temp_dir n1", SLURM_JOB_ID="7").stdout.strip() == "/tmp/ray-armor-7-n1"
    assert bash("check_container_paths /repo /repo/logs/slurm/x", **pyxis).returncode == 0
    outside = bash("check_container_paths /repo /scratch/job", **pyxis)
    assert outside.returncode == 1 and "add /scratch/job:/scratch/job" in outside.stderr
    assert "--container-workdir=/sub" in srun_words(
        "cd / && PWD=/sub set_srun_words n1", ARMOR_CONTAINER_IMAGE="/i.sqsh", **pyxis
    )


def test_a_job_without_its_gpus_is_refused_naming_the_sbatch_flag():
    refused = bash("check_job_gpus", ARMOR_RAY_NUM_GPUS="8")
    assert refused.returncode == 1
    assert "sbatch --gpus-per-node=8" in refused.stderr and "holds 0 GPU(s)" in refused.stderr
    assert bash("check_job_gpus", ARMOR_RAY_NUM_GPUS="8", SLURM_GPUS_ON_NODE="8").returncode == 0
    assert bash("check_job_gpus", ARMOR_RAY_NUM_GPUS="0").returncode == 0
