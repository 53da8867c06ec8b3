"""Slurm tier: docs/cluster.md, every fenced command in order, on the two-node CI cluster.

The commands are the page's, with only the replacements its "On a CPU cluster" table states
(preset ``cpu-container``, the CPU image, the tiny model and data, two nodes, no GPUs, the
torch backend), run from the repository root as a login-node shell would: one ``bash`` per
command after the page's own ``source`` lines. ``JOBID`` is the pipeline job's number. What the
page shows runs or fails the test: ``tail -f`` and ``tensorboard`` run until they show the run
(a step line; a page that answers) and are stopped; the test waits, on observable events only,
for the job's Ray bring-up before the page's ``scancel`` (its batch shell handles signals then;
it requeues at once: the two-node preemption mid-step, with the uninterrupted run's metrics,
is ``test_sbatch.py``'s) and for the job's end before step 7.
The hub is ``hub_mirror.HubMirror`` (a stand-in: the CI cluster has no network to it).

The walk writes what the page writes, under the CPU names of the table: megatron-armor-cpu/,
models/tiny-qwen2, data-ci/, runs/cpu_pipeline, logs/slurm/armor-JOBID, eval/armor_best and the
jobs' ``armor*-JOBID.out`` in the repository root (all ignored by git); an earlier walk's are
removed first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from hub_mirror import HubMirror
from slurm_jobs import FINAL_STATES, REPO, job_field, slurm, wait_until

from megatron_armor.config.resume_layout import COMMON

sys.path.insert(0, str(REPO / "tests"))
from doc_commands import fenced_commands  # noqa: E402

pytestmark = pytest.mark.slurm

PAGE = REPO / "docs" / "cluster.md"
CPU_SECTION = "## On a CPU cluster"
MIRROR_REPO = "armor-ci/tiny-qwen2"
OUTPUTS = ["models/tiny-qwen2", "data-ci", "runs/cpu_pipeline", "eval/armor_best"]
COMMAND_TIMEOUT_S = 600
JOB_TIMEOUT_S = 900
STEP = re.compile(r"^step \d+/\d+ ", re.M)


def cpu_replacements() -> list[tuple[str, str]]:
    """``(text, replacement)`` rows of the page's "On a CPU cluster" table, in order;
    ``(none)`` removes the text."""
    section = PAGE.read_text().split(CPU_SECTION, 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            new = "" if cells[1] == "(none)" else cells[1].strip("`")
            rows.append((cells[0].strip("`"), new))
    assert rows, f"no replacement table under {CPU_SECTION!r} in {PAGE}"
    return rows


def on_cpu_cluster(command: str, rows: list[tuple[str, str]], job_id: str) -> str:
    for old, new in rows:
        command = command.replace(old, new)
    return " ".join(command.replace("JOBID", job_id).split())


class Shell:
    """The login node: each command in ``bash`` after the page's ``source`` lines so far."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.sources: list[str] = []
        self.log: list[str] = []
        self.outputs: dict[str, str] = {}  # command -> its output
        self.seconds: list[tuple[float, str]] = []  # how long each command took

    def script(self, command: str) -> str:
        return "set -eo pipefail\n" + "".join(f"{s}\n" for s in self.sources) + command

    def run(self, command: str) -> subprocess.CompletedProcess:
        if command.startswith("source "):
            self.sources.append(command)
        started = time.monotonic()
        done = subprocess.run(["bash", "-c", self.script(command)], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)  # fmt: skip
        self.seconds.append((time.monotonic() - started, command))
        self.log.append(f"$ {command}\n(exit {done.returncode})\n{done.stdout[-3000:]}"
                        f"{done.stderr[-3000:]}")  # fmt: skip
        self.outputs[command] = done.stdout + done.stderr
        assert done.returncode == 0, self.report()
        return done

    def until(self, command: str, shown, what: str) -> str:
        """Start a command that does not end by itself; stop it once ``shown(output)``."""
        proc = subprocess.Popen(["bash", "-c", self.script(command)], cwd=REPO, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
        reader.start()

        def seen() -> bool:
            assert proc.poll() is None, f"{command} ended ({proc.returncode}): {''.join(out)}"
            return shown("".join(out))

        started = time.monotonic()
        try:
            wait_until(seen, 300, what, lambda: "".join(out)[-3000:])
        finally:
            with contextlib.suppress(ProcessLookupError):  # (it ended: the assertion says how)
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        self.seconds.append((time.monotonic() - started, command))
        self.log.append(f"$ {command}\n(shown, stopped)\n{''.join(out)[-2000:]}")
        return "".join(out)

    def report(self) -> str:
        took = "".join(f"{sec:6.1f}s {cmd[:100]}\n" for sec, cmd in self.seconds)
        return "\n".join(self.log[-6:]) + f"\n--- seconds per command\n{took}"


def tensorboard_answers(text: str) -> bool:
    """Whether the page TensorBoard printed the address of answers."""
    match = re.search(r"http://[\w.-]+:(\d+)/", text)
    if not match:
        return False
    try:
        url = f"http://127.0.0.1:{match.group(1)}/"
        return urllib.request.urlopen(url, timeout=5).status == 200
    except OSError:
        return False


def clear_earlier_walk() -> None:
    for path in OUTPUTS:
        shutil.rmtree(REPO / path, ignore_errors=True)


@pytest.fixture
def walk_jobs(two_nodes):
    """Job ids the walk submits; cancelled at teardown, however the test ended (again until
    they have ended: a job whose driver checkpoints on the cancel's SIGTERM requeues itself)."""
    ids: list[str] = []
    yield ids

    def ended() -> bool:
        live = [j for j in ids if job_field(j, "JobState") not in FINAL_STATES]
        if live:
            slurm("scancel", *live)
        return not live

    wait_until(ended, 120, f"the walk's jobs {ids} to end")


class Walk:
    """The page's commands in order on ``shell``; the waits a reader's eyes do on the job."""

    def __init__(self, shell: Shell, jobs: list[str]):
        self.shell = shell
        self.jobs = jobs
        self.job_id = ""

    def driver_started(self) -> bool:
        return bool(driver_log(self.job_id))

    def bringing_up_ray(self) -> bool:
        out = REPO / f"armor-{self.job_id}.out"
        return out.is_file() and "Ray head on" in out.read_text(errors="replace")

    def has_checkpoint(self, command: str) -> bool:
        where = REPO / command.split("--checkpoint", 1)[1].split()[0]
        return any(where.glob(f"**/{COMMON}"))  # a run checkpoint's layout record

    def job_ended(self) -> bool:
        return job_field(self.job_id, "JobState") in FINAL_STATES

    def step(self, command: str) -> None:
        if command.startswith("scancel"):  # once the batch shell handles signals
            wait_until(self.bringing_up_ray, JOB_TIMEOUT_S, "the job's Ray bring-up",
                       lambda: job_report(self.job_id))  # fmt: skip
        if "--checkpoint" in command:  # once the run has written a checkpoint there
            wait_until(lambda: self.has_checkpoint(command), JOB_TIMEOUT_S,
                       f"a checkpoint for {command!r}", lambda: job_report(self.job_id))  # fmt: skip
        if "slurm/convert.sbatch" in command:  # step 7: once the pipeline has ended
            wait_until(self.job_ended, JOB_TIMEOUT_S, f"pipeline job {self.job_id} to end",
                       lambda: job_report(self.job_id))  # fmt: skip
            assert job_field(self.job_id, "JobState") == "COMPLETED", job_report(self.job_id)
        if command.startswith("tail ") and " -f " in command:  # once the driver started
            wait_until(self.driver_started, JOB_TIMEOUT_S, "the driver's log",
                       lambda: job_report(self.job_id))  # fmt: skip
            self.shell.until(command, lambda out: bool(STEP.search(out)), "a step line")
        elif command.startswith("tensorboard"):
            self.shell.until(command, tensorboard_answers, "TensorBoard's page")
        else:
            submitted = re.search(r"Submitted batch job (\d+)", self.shell.run(command).stdout)
            if submitted:
                self.jobs.append(submitted.group(1))
                self.job_id = self.job_id or submitted.group(1)


def test_docs_cluster_md_runs_end_to_end_on_the_two_node_cpu_cluster(two_nodes, tiny_dir,
                                                                      walk_jobs):  # fmt: skip
    assert tiny_dir == (REPO / "artifacts" / "tiny").resolve(), (
        "the page's CPU data are artifacts/tiny/data: run the tier without ARMOR_TINY_DIR"
    )
    clear_earlier_walk()
    rows = cpu_replacements()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ARMOR_", "SLURM_", "HF_HUB_OFFLINE", "VIRTUAL_ENV"))}  # fmt: skip
    with HubMirror(tiny_dir / "model", MIRROR_REPO) as mirror:
        env["HF_ENDPOINT"] = mirror.endpoint
        walk = Walk(Shell(env), walk_jobs)
        for doc_command in fenced_commands(PAGE, until=CPU_SECTION):
            command = on_cpu_cluster(doc_command.text, rows, walk.job_id)
            if command:  # (a step the table replaces by nothing)
                walk.step(command)
    assert walk.job_id, "the page submitted no job"
    check_the_walk(walk.job_id, walk.shell)


def driver_log(job_id: str) -> str:
    path = REPO / "logs" / "slurm" / f"armor-{job_id}" / "driver.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def job_out(job_id: str) -> str:
    out = REPO / f"armor-{job_id}.out"
    return out.read_text(errors="replace") if out.is_file() else ""


def job_report(job_id: str) -> str:
    return f"{job_out(job_id)[-3000:]}\n--- driver.log\n{driver_log(job_id)[-4000:]}"


def check_the_walk(job_id: str, shell: Shell) -> None:
    """What the page promises, read from the files the commands wrote."""
    log = shell.report()
    # the preemption during the Ray bring-up: requeued at once, the pipeline then ran through
    # (a preemption mid-step on two nodes: test_sbatch.py, with the uninterrupted metrics)
    assert int(job_field(job_id, "Restarts")) >= 1, job_report(job_id)
    assert "requeueing job" in job_out(job_id) and "received SIGTERM" in job_out(job_id)
    state = json.loads((REPO / "runs/cpu_pipeline/pipeline.json").read_text())
    assert state["stage"] == "done", state
    exported = json.loads((REPO / "runs/cpu_pipeline/armor_best_hf/config.json").read_text())
    assert exported["model_type"] == "qwen2", exported
    results = json.loads((REPO / "eval/armor_best/eval.json").read_text())["results"]
    assert set(results) == {"aime24", "aime25", "amc23"}, results
    doctor = next(out for cmd, out in shell.outputs.items() if "armor doctor" in cmd)
    for node in ("armor-n1", "armor-n2"):  # every node's table, from rank 0, and the all-reduce
        assert f"({node}, rank" in doctor, doctor[-3000:]
    assert "cross-node all-reduce" in doctor and "ARMOR_ENV=cpu-container" in doctor, log
    assert (REPO / "models/tiny-qwen2/config.json").is_file()  # hf download from the mirror
    assert sorted(p.name for p in (REPO / "data-ci").glob("*.parquet")) == [
        "aime24.parquet", "aime25.parquet", "amc23.parquet", "dapo-math-17k.parquet",
        "math500.parquet"]  # fmt: skip
    ray_logs = REPO / "logs" / "slurm" / f"armor-{job_id}" / "ray-logs"
    assert len(list(ray_logs.iterdir())) == 2, "Ray's /dev/shm logs of both nodes kept"
    assert not list(Path("/dev/shm").glob(f"ray-armor-{job_id}-*")), "Ray's temp dirs cleared"
    print(shell.report().rsplit("--- seconds per command", 1)[1])  # shown with pytest -s
