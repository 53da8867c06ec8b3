"""Cluster presets (``slurm/env/*.sh``) outside the sbatch files: each one sourced alone from
another directory, and ``armor doctor`` applying ``ARMOR_ENV``'s, so that its NCCL checks run
with the preset's settings. Tier: unit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_armor.doctor.preset import preset_changes

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (REPO / "slurm" / "env").glob("*.sh"))


def without_armor_root() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("ARMOR_", "NCCL_"))}


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_can_be_sourced_alone(name, tmp_path):
    """`source slurm/env/NAME.sh` from anywhere, without ARMOR_ROOT: the preset finds its
    repository (h100-roce sources h100-ib beside it)."""
    done = subprocess.run(["bash", "-c", f'set -eu; source "{REPO}/slurm/env/{name}.sh"; '
                           'echo "$ARMOR_ROOT|${ARMOR_LAUNCHER:-none}"'],
                          cwd=tmp_path, env=without_armor_root(), capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split("|")[0] == str(REPO)


def test_a_preset_fills_in_only_what_is_unset():
    env = {**without_armor_root(), "NCCL_IB_HCA": "mlx5_0,mlx5_1"}
    changes = preset_changes("h100-roce", env, REPO)
    assert changes["NCCL_IB_GID_INDEX"] == "3" and changes["ARMOR_LAUNCHER"] == "pyxis"
    assert "NCCL_IB_HCA" not in changes  # the site's own value stays


def test_armor_doctor_applies_armor_env_and_names_an_unknown_preset(tmp_path):
    """`ARMOR_ENV=h100-ib srun ... armor doctor` (docs/cluster.md): the doctor sources the
    preset, as the sbatch files do, before its checks."""
    run = [sys.executable, "-m", "megatron_armor.cli", "doctor", "--check", "versions"]
    env = {**without_armor_root(), "PYTHONPATH": str(REPO), "ARMOR_ENV": "h100-ib"}
    done = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "ARMOR_ENV=h100-ib:" in done.stdout and "NCCL_IB_HCA=mlx5" in done.stdout, done.stdout
    env["ARMOR_ENV"] = "h100-nope"
    done = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "choose one of: cpu-ci, cpu-container" in done.stderr
