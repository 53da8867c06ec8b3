"""Helpers of the Slurm tier (imported by its tests and fixtures; see ``conftest.py``):
the CI cluster's topology, job submission through ``slurm/armor.sbatch``, bounded waits, and
cancelling a test's jobs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLURM_COMMANDS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue")
STATE_DIR = Path(os.environ.get("ARMOR_SLURM_STATE", "/var/lib/armor-slurm-ci"))
JOB_NAME = "armor-tier"
JOB_TIMEOUT_S = 600
IDLE_TIMEOUT_S = 90
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# Small and fast: the tiny config without validation, TensorBoard or progress bars.
FAST = ["validation.every=0", "logging.tensorboard=false", "logging.progress=false"]


def missing_commands() -> list[str]:
    return [c for c in SLURM_COMMANDS if shutil.which(c) is None]


def slurm(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def job_field(job_id: str, name: str) -> str:
    out = slurm("scontrol", "show", "job", "-o", job_id).stdout
    match = re.search(rf"\b{name}=(\S+)", out)
    return match.group(1) if match else ""


def wait_until(predicate, timeout_s: float, what: str, report=lambda: "") -> None:
    """Poll ``predicate`` every half second; fail naming ``what`` (and the report) on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{report()}")


def make_workdir(tiny_dir: Path, path: Path) -> Path:
    """A job working directory whose ``artifacts/tiny`` is the built tiny model + data."""
    (path / "artifacts").mkdir(parents=True, exist_ok=True)
    (path / "artifacts" / "tiny").symlink_to(tiny_dir)
    return path


@dataclass
class Cluster:
    """The running CI cluster: its node names and, for one node, why not two."""

    nodes: list[str]
    single_node_reason: str = ""

    @property
    def two_nodes(self) -> bool:
        return len(self.nodes) >= 2


def topology() -> tuple[str, str]:
    """(``two-node`` | ``single-node``, reason) from install_slurm.sh's topology file."""
    path = STATE_DIR / "topology"
    text = path.read_text().strip() if path.is_file() else ""
    if text == "two-node":
        return "two-node", ""
    reason = (
        text.partition(":")[2].strip()
        or f"{path} is missing (cluster not made by install_slurm.sh)"
    )
    return "single-node", reason


def check_subnet(kind: str) -> None:
    """Two nodes: no Slurm client runs before the bridge exists (its subnet would be routed off
    this machine)."""
    if kind != "two-node":
        return
    has_net = subprocess.run(["bash", str(REPO / "slurm/ci/netns_nodes.sh"), "has-net"], timeout=30)
    assert has_net.returncode == 0, (
        "the two-node cluster's bridge is missing: run `bash slurm/ci/install_slurm.sh` as root"
    )


def cancel_stale_jobs(say) -> None:
    stale = slurm("squeue", "-h", "-n", JOB_NAME, "-o", "%i").stdout.split()
    if stale:
        say(f"slurm tier: cancelling {len(stale)} job(s) left by an earlier run: {' '.join(stale)}")
        slurm("scancel", *stale)


def wait_idle(nodes: list[str]) -> None:
    def idle() -> bool:
        states = slurm("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        return all(line.split()[1] == "idle" for line in states if line.strip())

    wait_until(idle, IDLE_TIMEOUT_S, f"idle Slurm nodes {nodes}",
               lambda: slurm("sinfo", "-N").stdout + slurm("squeue").stdout)  # fmt: skip


def container_env(workdir: Path) -> dict[str, str]:
    """``cpu-container`` for a job of ``workdir``: every step its own container (pyxis's flags,
    ``slurm/ci/pyxis_srun.py``) that sees the repository and the job's working directory."""
    return {"ARMOR_ENV": "cpu-container",
            "ARMOR_CONTAINER_MOUNTS": f"{REPO}:{REPO},{workdir}:{workdir}"}  # fmt: skip


@dataclass
class Job:
    """One submitted ``slurm/armor.sbatch`` job: its id, working dir and job dir."""

    job_id: str
    workdir: Path

    @property
    def job_dir(self) -> Path:
        return self.workdir / "logs" / f"{JOB_NAME}-{self.job_id}"

    @property
    def out(self) -> Path:
        return self.workdir / f"job-{self.job_id}.out"

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / "tiny_cpu"

    def field(self, name: str) -> str:
        return job_field(self.job_id, name)

    def nodes(self) -> list[str]:
        """The job's nodes, the batch host (Ray head) first."""
        names = slurm("scontrol", "show", "hostnames", self.field("NodeList")).stdout.split()
        head = self.field("BatchHost")
        return sorted(names, key=lambda n: n != head)

    def driver_log(self) -> str:
        path = self.job_dir / "driver.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def report(self) -> str:
        """Tails of the job's stdout, driver log and Ray logs, for failure messages."""
        files = [self.out, self.job_dir / "driver.log", *sorted(self.job_dir.glob("ray-*.log"))]
        return "\n".join(
            f"--- {p.name} (tail)\n{p.read_text(errors='replace')[-3000:]}"
            for p in files
            if p.is_file()
        )

    def wait_done(self, timeout_s: float = JOB_TIMEOUT_S) -> str:
        """The final state; the job is cancelled (and the test fails) on the deadline."""
        state = {"s": ""}

        def finished() -> bool:
            state["s"] = self.field("JobState")
            return state["s"] in FINAL_STATES

        try:
            wait_until(finished, timeout_s, f"job {self.job_id} to finish", self.report)
        except AssertionError:
            slurm("scancel", self.job_id)
            raise
        return state["s"]


@dataclass
class SlurmJobs:
    """Submits ``slurm/armor.sbatch`` jobs of the tiny config; :meth:`cancel_all` ends them."""

    jobs: list[Job] = field(default_factory=list)

    def submit(
        self, workdir: Path, overrides: list[str], nodes: int = 1, env: dict | None = None
    ) -> Job:
        env = {
            **os.environ,
            "ARMOR_ENV": "cpu-ci",
            "ARMOR_ROOT": str(REPO),
            "ARMOR_LOG_ROOT": str(workdir / "logs"),
            "ARMOR_PYTHON": sys.executable,
            **(env or {}),
        }
        cmd = [
            "sbatch", "--parsable", f"--job-name={JOB_NAME}", f"--nodes={nodes}",
            f"--chdir={workdir}", f"--output={workdir}/job-%j.out", "--time=20",
            str(REPO / "slurm" / "armor.sbatch"), str(REPO / "configs" / "tiny_cpu.yaml"),
            f"run.output_dir={workdir}/runs", *FAST, *overrides,
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, f"sbatch failed: {done.stderr}"
        job = Job(done.stdout.strip().split(";")[0], workdir)
        self.jobs.append(job)
        return job

    def cancel_all(self) -> None:
        """Cancel this test's jobs that are not finished and wait (bounded) until they are."""
        live = [j.job_id for j in self.jobs if j.field("JobState") not in FINAL_STATES]
        if not live:
            return
        slurm("scancel", *live)
        wait_until(
            lambda: all(job_field(j, "JobState") in FINAL_STATES for j in live),
            120,
            f"cancelled jobs {live} to end",
        )
