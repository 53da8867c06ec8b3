"""launch/profile.sh builds the profiler command lines (unit tier, dry run: nothing is started),
and, around stand-ins for nsys and the driver, ends with the run's page, the reports in its run
directory and the run's exit code."""

from __future__ import annotations

import os
import re
import signal
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


REPO = SCRIPT.parents[1]
FIXTURE = REPO / "tests" / "unit" / "fixtures" / "one_step_run"
STANDIN_NSYS = """#!/usr/bin/env bash
# Stands for Nsight Systems' `nsys profile ... COMMAND`: writes an empty report where --output
# says and runs COMMAND. It captures nothing (no GPU here); the launcher's handling of the
# report is what it shows.
while [ "${1#-}" != "$1" ] || [ "$1" = profile ]; do
  case "$1" in --output=*) touch "${1#--output=}.nsys-rep" ;; esac
  shift
done
exec "$@"
"""
STANDIN_DRIVER = """#!/usr/bin/env bash
# Stands for `armor train CONFIG OVERRIDES`: puts the recorded run directory of
# tests/unit/fixtures/one_step_run where run.output_dir / run.name say, or, with
# STANDIN_WAIT set, waits for a signal and exits 75 as the driver does after its checkpoint.
# It trains nothing: the launcher around it is what it shows.
for a in "$@"; do case "$a" in run.output_dir=*) out=${a#*=} ;; run.name=*) name=${a#*=} ;; esac; done
if [ -n "${STANDIN_WAIT:-}" ]; then
  trap 'echo "$1" > "$STANDIN_WAIT.signal"; exit 75' TERM
  touch "$STANDIN_WAIT"
  while :; do sleep 1; done
fi
mkdir -p "$out" && cp -r "$STANDIN_FIXTURE" "$out/$name"
"""


def _standins(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nsys").write_text(STANDIN_NSYS)
    (bin_dir / "train").write_text(STANDIN_DRIVER)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARMOR_DRY_RUN": "0",
            "ARMOR_DRIVER": str(bin_dir / "train"), "STANDIN_FIXTURE": str(FIXTURE)}  # fmt: skip


def test_the_run_ends_with_its_page_and_the_reports_in_its_run_directory(tmp_path):
    env = _standins(tmp_path)
    args = ["--tool", "nsys", "--steps", "3", "--out", str(tmp_path / "capture"),
            str(REPO / "configs" / "tiny_cpu.yaml"), f"run.output_dir={tmp_path}", "run.name=prof"]  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "capture" / "prof"  # the profiled run is its own, under --out
    assert not (tmp_path / "prof").exists()  # the real run's directory is never touched
    assert (run_dir / "profile" / "armor.nsys-rep").is_file()  # gathered from --out
    page = (run_dir / "report" / "report.md").read_text()
    assert "`profile/armor.nsys-rep`" in page and "## Where the time goes" in page


def test_a_stop_signal_reaches_the_run_and_its_exit_code_comes_back(tmp_path):
    env = {**_standins(tmp_path), "STANDIN_WAIT": str(tmp_path / "waiting")}
    args = [
        "--tool",
        "torch",
        "--out",
        str(tmp_path / "t"),
        str(REPO / "configs" / "tiny_cpu.yaml"),
    ]
    proc = subprocess.Popen(["bash", str(SCRIPT), *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(600):  # the stand-in driver says it waits (a file), checked each 0.1 s
            if (tmp_path / "waiting").exists() or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert (tmp_path / "waiting").exists(), proc.communicate(timeout=60)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert (tmp_path / "waiting.signal").is_file()


def test_the_container_ships_nsight_systems_matched_to_its_cuda():
    """docker/Dockerfile (built on GPU machines only): Nsight Systems from the CUDA repository
    of its base image, for its CUDA version, and a build that stops without `nsys`."""
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    cuda = re.search(r"^ARG CUDA_VERSION=(\d+)\.(\d+)", dockerfile, re.M).groups()
    assert "cuda-nsight-systems-${cuda_mm}" in dockerfile and "ARG CUDA_VERSION\n" in dockerfile
    cuda_mm = subprocess.run(["bash", "-c", 'echo "$V" | cut -d. -f1,2 | tr . -'], env={
        "V": ".".join(cuda) + ".1", "PATH": os.environ["PATH"]}, capture_output=True,
        text=True, check=True).stdout.strip()  # fmt: skip
    assert cuda_mm == "-".join(cuda)  # 13.0.1 -> cuda-nsight-systems-13-0
    assert dockerfile.index("nsys --version") < dockerfile.index("COPY requirements.txt")
