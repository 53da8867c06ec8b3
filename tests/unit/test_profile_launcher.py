"""launch/profile.sh builds the profiler command lines (unit tier, dry run: nothing is started)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "profile.sh"


def _run(*args: str, dry: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "ARMOR_DRY_RUN": "1" if dry else "0", "ARMOR_DRIVER": "armor-train"}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=30
    )


def test_nsys_captures_only_the_chosen_steps():
    done = _run("--tool", "nsys", "--steps", "3,4", "--out", "/tmp/p", "cfg.yaml", "run.steps=5")
    assert done.returncode == 0, done.stderr
    cmd = done.stdout
    assert cmd.startswith("nsys profile ")
    assert "--capture-range=cudaProfilerApi" in cmd and "--trace=cuda" in cmd
    assert "--trace-fork-before-exec=true" in cmd and "--output=/tmp/p/armor" in cmd
    assert "armor-train cfg.yaml run.steps=5 logging.profile=nsys" in cmd
    assert "logging.profile_steps=\\[3\\,4\\]" in cmd
    assert "run.output_dir=/tmp/p" in cmd  # a run of its own: never the real run's directory


def test_nvtx_capture_names_the_step_range():
    done = _run("--tool", "nsys", "--capture", "nvtx", "--steps", "2", "cfg.yaml")
    assert "--capture-range=nvtx" in done.stdout
    assert "--nvtx-capture=profile/step_2@armor" in done.stdout


def test_torch_needs_no_tool_and_bad_arguments_are_named():
    done = _run("--tool", "torch", "--steps", "2", "--out", "/tmp/t", "cfg.yaml")
    assert done.stdout.startswith("armor-train cfg.yaml logging.profile=torch")
    assert "run.output_dir=/tmp/t" in done.stdout
    assert "--steps two" in _run("--steps", "two", "cfg.yaml").stderr
    assert "--tool perf" in _run("--tool", "perf", "cfg.yaml").stderr


def test_dlprof_without_the_tool_says_what_to_use():
    if subprocess.run(["bash", "-c", "command -v dlprof"], capture_output=True).returncode == 0:
        pytest.skip("dlprof is installed here")
    done = _run("--tool", "dlprof", "cfg.yaml", dry=False)
    assert done.returncode != 0
    assert "DLProf tool is not installed" in done.stderr and "--tool nsys" in done.stderr
