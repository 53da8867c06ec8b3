"""One writer per run directory: ``run_dir/.lock`` names the writer (host, pid, the process's
start time, the Slurm job and its restart) so that a lock left by a dead writer is recognized.

The lock file is created with ``O_CREAT | O_EXCL`` (atomic, also on NFS v3+). A second run on
the same directory is refused with :class:`RunDirLocked`, naming the holder and the command
that clears the lock. A lock is taken over, with a line saying why, when its writer is gone:

- an earlier start of this Slurm job (same job id, another ``SLURM_RESTART_COUNT``: a
  requeued job runs one start at a time), or a Slurm job that is no longer running
  (``squeue``; inside a container, which has no Slurm client, the file
  ``ARMOR_SLURM_JOB_STATES`` that ``slurm/armor.sbatch`` writes at each start: ``squeue``'s
  ``JOBID STATE`` lines of the user's jobs; where neither answers, this is unknown);
- on this host: its pid is not alive, or is a process started at another time (the pid was
  reused: ``/proc/PID/stat`` field 22).

A lock from another host whose job cannot be checked is never taken over.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

LOCK_FILE = ".lock"
RUNNING_STATES = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING",
                  "RESIZING", "STAGE_OUT"}  # fmt: skip
"""``squeue`` states in which a job's processes may still write (a PENDING or REQUEUED job,
and one no longer listed, has none)."""


class RunDirLocked(RuntimeError):
    """Another live run writes this run directory."""


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: a driver killed with its ``armor`` parent is
    re-parented to init, which may reap it only later (it holds nothing but its pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc here: trust the signal check
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field 22);
    ``None`` where it cannot be read (no such process, no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": field 3 onwards
    return int(fields[19]) if len(fields) > 19 else None


def slurm_job_running(job_id: str, uid: int | None = None) -> bool | None:
    """Whether Slurm job ``job_id`` (of user ``uid``) is running (:data:`RUNNING_STATES`);
    ``None`` when it cannot be told (no ``squeue`` here and no job states file from the batch
    host, or Slurm does not answer)."""
    if shutil.which("squeue") is None:
        return job_running_in_states_file(job_id, uid)
    try:
        done = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return False if "Invalid job id" in done.stderr else None  # purged: long finished
    return any(state in RUNNING_STATES for state in done.stdout.split())


def job_running_in_states_file(job_id: str, uid: int | None) -> bool | None:
    """:func:`slurm_job_running` from ``ARMOR_SLURM_JOB_STATES`` (``squeue -u USER -o '%i %T'``
    on the batch host as this job started): it lists every job of this user, so a job of this
    user that it lacks has ended; another user's job, or no file, is unknown (``None``)."""
    path = os.environ.get("ARMOR_SLURM_JOB_STATES")
    if not path or uid != os.getuid():
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    states = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
    return states.get(str(job_id)) in RUNNING_STATES


def this_writer() -> dict:
    """The lock record of this process."""
    return {
        "pid": os.getpid(), "uid": os.getuid(), "host": socket.gethostname(),
        "since": time.time(),
        "start_ticks": process_start_ticks(os.getpid()),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
    }  # fmt: skip


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # half-written by a writer killed mid-create: treated as stale


def stale_reason(holder: dict) -> str | None:
    """Why the writer of lock record ``holder`` is gone, or ``None`` while it may be alive."""
    if not holder:
        return "an unreadable lock (its writer died while creating it)"
    job, mine = holder.get("slurm_job"), os.environ.get("SLURM_JOB_ID")
    if (
        job
        and job == mine
        and holder.get("slurm_restart") != os.environ.get("SLURM_RESTART_COUNT", "0")
    ):
        return f"an earlier start (restart {holder.get('slurm_restart')}) of this Slurm job {job}"
    if job and job != mine and slurm_job_running(job, holder.get("uid")) is False:
        return f"Slurm job {job} is no longer running"
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return f"pid {pid} is no longer running"
    ticks = holder.get("start_ticks")
    if ticks is not None and process_start_ticks(pid) not in (None, ticks):
        return f"pid {pid} is now another process (started at another time)"
    return None


class RunLock:
    """Held from :meth:`acquire` to :meth:`release` by the driver of one run."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(this_writer(), f)
        return True

    def acquire(self) -> RunLock:
        """Take the lock, replacing a stale one (:func:`stale_reason`); raise
        :class:`RunDirLocked` when a live run holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock removed by two starters at once: retry the create
            if self._create():
                self.held = True
                return self
            holder = _read(self.path)
            reason = stale_reason(holder)
            if reason is None:
                raise RunDirLocked(self._refusal(holder))
            print(f"{self.path}: taking over the stale lock of {describe(holder)}: {reason}",
                  flush=True)  # fmt: skip
            self.path.unlink(missing_ok=True)
        raise RunDirLocked(f"{self.path}: could not take the lock; another run is starting here")

    def _refusal(self, holder: dict) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
        job = holder.get("slurm_job")
        stop = f"`scancel {job}`" if job else f"`kill {holder.get('pid')}` on {holder.get('host')}"
        return (
            f"{self.path.parent} is in use by another run ({describe(holder)}, since {since}); "
            "two runs must not write one run directory: wait for it, stop it "
            f"({stop}), or pick another run.name / run.output_dir. If that run is gone (e.g. "
            f"its node died), clear the lock: rm {self.path}"
        )

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held and _read(self.path).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def describe(holder: dict) -> str:
    """``pid P on HOST (Slurm job J)`` of a lock record."""
    job = f" (Slurm job {holder['slurm_job']})" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}"
