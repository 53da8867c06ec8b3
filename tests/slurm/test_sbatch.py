"""Slurm tier: the project's ``slurm/armor.sbatch`` on a real single-node cluster.

The cluster (munge + slurmctld + slurmd from Debian packages) is started by
``slurm/ci/install_slurm.sh``, which ``scripts/test.sh`` runs before pytest. These tests skip
only when the Slurm commands are not installed at all; with Slurm present they run, and a
cluster that does not answer is a failure. Each job is the tiny CPU config through the real
path: Ray head started by the sbatch file, ``armor train`` as the driver, checkpoints on a
signal, ``scontrol requeue`` and ``--resume auto``. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SLURM_COMMANDS = ("sbatch", "scontrol", "scancel", "sinfo")
JOB_TIMEOUT_S = 900
# Small and fast: a few steps of the tiny config, no validation.
FAST = ["validation.every=0", "logging.tensorboard=false", "logging.progress=false"]


def _missing_commands() -> list[str]:
    return [c for c in SLURM_COMMANDS if shutil.which(c) is None]


@pytest.fixture(scope="module")
def cluster():
    missing = _missing_commands()
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing): run "
            "`bash slurm/ci/install_slurm.sh` as root (scripts/test.sh does) to enable this tier"
        )
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    assert ping.returncode == 0, (
        f"Slurm is installed but slurmctld does not answer: {ping.stdout}{ping.stderr}"
    )
    state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    assert re.search(r"idle|mix", state.stdout), f"no idle Slurm node: sinfo says {state.stdout!r}"


@pytest.fixture(scope="module")
def tiny_dir(cluster) -> Path:
    """The tiny model + data: ``$ARMOR_TINY_DIR`` or ``artifacts/tiny`` (shared with the e2e
    tier), built with ``armor tiny`` when missing."""
    path = Path(os.environ.get("ARMOR_TINY_DIR", REPO / "artifacts" / "tiny")).resolve()
    if (
        not (path / "model" / "config.json").is_file()
        or not (path / "data" / "val.parquet").is_file()
    ):
        cmd = [sys.executable, "-m", "megatron_armor.cli", "tiny", "--out", str(path)]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (
            f"`armor tiny` failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return path


def _job_field(job_id: str, name: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    match = re.search(rf"\b{name}=(\S+)", out.stdout)
    return match.group(1) if match else ""


def _submit(workdir: Path, overrides: list[str]) -> tuple[str, Path]:
    env = {
        **os.environ,
        "ARMOR_ENV": "cpu-ci",
        "ARMOR_ROOT": str(REPO),
        "ARMOR_LOG_ROOT": str(workdir / "logs"),
        "ARMOR_PYTHON": sys.executable,
    }
    cmd = [
        "sbatch", "--parsable", f"--chdir={workdir}", f"--output={workdir}/job-%j.out",
        "--time=20", str(REPO / "slurm" / "armor.sbatch"),
        str(REPO / "configs" / "tiny_cpu.yaml"), f"run.output_dir={workdir}/runs", *FAST, *overrides,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, f"sbatch failed: {done.stderr}"
    job_id = done.stdout.strip().split(";")[0]
    return job_id, workdir / "logs" / f"armor-{job_id}"


def _job_report(workdir: Path, job_id: str, job_dir: Path) -> str:
    """Tails of the job's stdout, driver log and Ray logs, for failure messages."""
    files = [
        workdir / f"job-{job_id}.out",
        job_dir / "driver.log",
        *sorted(job_dir.glob("ray-*.log")),
    ]
    return "\n".join(
        f"--- {p.name} (tail)\n{p.read_text(errors='replace')[-3000:]}"
        for p in files
        if p.is_file()
    )


def _wait_until(predicate, timeout_s: float, what: str, report) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{report()}")


def _wait_done(job_id: str, workdir: Path, job_dir: Path) -> str:
    """Poll until the job is in a final state; cancel it (and fail) on the deadline."""
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    state = {"s": ""}

    def finished() -> bool:
        state["s"] = _job_field(job_id, "JobState")
        return state["s"] in final

    try:
        _wait_until(
            finished,
            JOB_TIMEOUT_S,
            f"job {job_id} to finish",
            lambda: _job_report(workdir, job_id, job_dir),
        )
    except AssertionError:
        subprocess.run(["scancel", job_id], timeout=30)
        raise
    return state["s"]


@pytest.fixture
def workdir(tiny_dir, tmp_path) -> Path:
    """A job working directory whose ``artifacts/tiny`` is the built tiny model + data."""
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "tiny").symlink_to(tiny_dir)
    return tmp_path


def test_sbatch_runs_the_tiny_config_to_completion_with_a_torch_profile(workdir):
    profile = [
        "logging.profile=torch",
        "logging.profile_steps=[2]",
    ]  # the trainer's trace of step 2
    job_id, job_dir = _submit(workdir, ["run.steps=2", "run.ckpt_every=2", *profile])
    state = _wait_done(job_id, workdir, job_dir)
    report = _job_report(workdir, job_id, job_dir)
    assert state == "COMPLETED", report
    assert _job_field(job_id, "ExitCode") == "0:0", report
    driver = (job_dir / "driver.log").read_text()
    assert "step 2/2" in driver, report
    assert "orchestration.ray_address=" in driver  # the driver used the job's own Ray head
    assert (workdir / "runs" / "tiny_cpu" / "checkpoints" / "step_000002" / "meta.json").is_file()
    assert (job_dir / f"ray-{_job_field(job_id, 'BatchHost')}.log").is_file()
    trace = json.loads(
        (workdir / "runs" / "tiny_cpu" / "profile" / "trace_rank0_step2.json").read_text()
    )
    names = {event.get("name") for event in trace["traceEvents"]}
    assert any(str(n).startswith("aten::") for n in names)  # forward ops of the trainer rank
    assert any(str(n).endswith("Backward0") for n in names)  # and its backward pass


def test_sigusr1_checkpoints_requeues_and_the_requeued_job_resumes(workdir):
    # Enough steps that the signal (sent once step 1 is logged; the log is polled every 2 s)
    # lands well before the last one, however fast a step is on the machine running this.
    steps = 16
    job_id, job_dir = _submit(workdir, [f"run.steps={steps}", "run.ckpt_every=100"])
    driver_log = job_dir / "driver.log"
    report = lambda: _job_report(workdir, job_id, job_dir)  # noqa: E731
    _wait_until(
        lambda: driver_log.is_file() and f"step 1/{steps}" in driver_log.read_text(),
        JOB_TIMEOUT_S,
        "the first training step",
        report,
    )
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    state = _wait_done(job_id, workdir, job_dir)
    out = report()
    assert state == "COMPLETED", out
    assert _job_field(job_id, "Restarts") == "1", out
    driver = driver_log.read_text()
    saved = re.search(r"SIGUSR1: checkpoint of step (\d+) written; exiting 75", driver)
    assert saved, out
    step = int(saved.group(1))
    assert 1 <= step < steps
    assert "requeueing job" in (workdir / f"job-{job_id}.out").read_text()
    assert re.search(rf"resumed from \S+step_{step:06d} at step {step}", driver), out
    assert f"step {steps}/{steps}" in driver.split("=== restart 1")[-1], out
    ckpts = workdir / "runs" / "tiny_cpu" / "checkpoints"
    assert (ckpts / f"step_{steps:06d}" / "meta.json").is_file(), out


def test_join_check_names_the_missing_node_and_fails_fast_when_a_launcher_dies(tmp_path):
    """slurm/lib: a head from ray_node.sh, then the join check for the head plus a node that never comes."""
    port = 20000 + os.getpid() % 20000
    env = {
        **os.environ,
        "ARMOR_ROOT": str(REPO),
        "ARMOR_RAY": str(Path(sys.executable).parent / "ray"),
        "ARMOR_PYTHON": sys.executable,
        "ARMOR_RAY_PORT": str(port),
        "ARMOR_RAY_NUM_CPUS": "1",
        "ARMOR_RAY_OBJECT_STORE_MB": "128",
        "ARMOR_RAY_TEMP_DIR": f"/tmp/ray-armor-t{os.getpid()}",
        "SLURMD_NODENAME": "headnode",
        "RAY_AUTH_MODE": "disabled",
    }
    log = open(tmp_path / "ray-head.log", "w")
    head = subprocess.Popen(
        [str(REPO / "slurm" / "lib" / "ray_node.sh"), "head"], env=env, stdout=log, stderr=log
    )
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        address = f"{_head_ip(env)}:{port}"
        waiter = [
            sys.executable,
            str(REPO / "slurm" / "lib" / "wait_for_ray_nodes.py"),
            "--address",
            address,
        ]
        ok = subprocess.run(
            [*waiter, "--nodes", "headnode", "--timeout", "60"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert ok.returncode == 0, ok.stderr
        late = subprocess.run(
            [*waiter, "--nodes", "headnode,ghost-node", "--timeout", "10"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert late.returncode == 1, late.stderr
        assert "ghost-node missing" in late.stderr and "not joined after 10s" in late.stderr
        start = time.monotonic()
        fast = subprocess.run(
            [*waiter, "--nodes", "headnode,ghost-node", "--timeout", "600", "--watch", f"ghost-node={dead.pid}"],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert fast.returncode == 1 and "its Ray start exited" in fast.stderr
        assert time.monotonic() - start < 120  # did not wait for the 600 s deadline
    finally:
        head.send_signal(signal.SIGUSR2)  # stops the Ray processes it started (ray_node.py)
        head.wait(timeout=60)
        log.close()


def _head_ip(env: dict[str, str]) -> str:
    out = subprocess.run(
        ["bash", "-c", f"source {REPO}/slurm/lib/common.sh && node_ip"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    return out.stdout.strip()
