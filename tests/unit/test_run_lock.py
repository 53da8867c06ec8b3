"""The run lock (``orchestration/run/run_lock.py``): a lock whose writer is gone is taken over
with a line saying why, a live writer's is refused naming it and the command that clears it.
Slurm is a recording ``squeue`` on ``PATH``. Tier: unit."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_armor.orchestration.run.run_lock import (
    LOCK_FILE,
    RunDirLocked,
    RunLock,
    process_start_ticks,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """``slurm(states)``: a fake ``squeue`` on PATH printing ``states`` (``None``: no Slurm
    commands at all); this process outside any Slurm job. Returns the file of its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "squeue.calls"
    bin_dir.mkdir()
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)

    def install(states: str | None) -> Path:
        monkeypatch.setenv("PATH", str(bin_dir))
        if states is not None:
            script = bin_dir / "squeue"
            script.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nprintf '{states}'\n")
            script.chmod(script.stat().st_mode | stat.S_IEXEC)
        return calls

    return install


def write_lock(run_dir: Path, **holder) -> None:
    record = {"pid": 1, "host": "node-gone", "since": 0, **holder}
    (run_dir / LOCK_FILE).write_text(json.dumps(record))


def test_a_lock_of_a_slurm_job_that_no_longer_runs_is_taken_over(tmp_path, slurm, capsys):
    calls = slurm("")  # the job is no longer listed
    write_lock(tmp_path, slurm_job="4242")
    lock = RunLock(tmp_path).acquire()
    out = capsys.readouterr().out
    assert "taking over the stale lock of pid 1 on node-gone (Slurm job 4242)" in out
    assert "Slurm job 4242 is no longer running" in out
    assert "-j 4242" in calls.read_text()
    mine = json.loads((tmp_path / LOCK_FILE).read_text())
    assert mine["pid"] == os.getpid() and mine["start_ticks"] == process_start_ticks(os.getpid())
    lock.release()


def test_an_earlier_start_of_this_requeued_job_is_taken_over(tmp_path, slurm, monkeypatch):
    slurm(None)  # no squeue needed: Slurm runs one start of a job at a time
    write_lock(tmp_path, slurm_job="77", slurm_restart="0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    RunLock(tmp_path).acquire().release()


def test_a_reused_pid_on_this_host_is_taken_over(tmp_path, slurm, capsys):
    slurm(None)
    # this process is alive, but the lock's writer started at another time
    write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname(),
               start_ticks=process_start_ticks(os.getpid()) - 1)  # fmt: skip
    RunLock(tmp_path).acquire().release()
    assert f"pid {os.getpid()} is now another process" in capsys.readouterr().out
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    write_lock(tmp_path, pid=int(dead.stdout), host=socket.gethostname())
    RunLock(tmp_path).acquire().release()
    assert "is no longer running" in capsys.readouterr().out


def test_a_live_holder_is_refused_naming_it_and_the_command_that_clears_the_lock(tmp_path, slurm):
    slurm("RUNNING\n")
    write_lock(tmp_path, slurm_job="4242")
    with pytest.raises(RunDirLocked) as refused:
        RunLock(tmp_path).acquire()
    message = str(refused.value)
    assert "in use by another run (pid 1 on node-gone (Slurm job 4242)" in message
    assert "`scancel 4242`" in message and f"rm {tmp_path / LOCK_FILE}" in message
    first = RunLock(tmp_path / "mine").acquire()  # this process, this host: alive, same start
    with pytest.raises(RunDirLocked, match=f"`kill {os.getpid()}` on {socket.gethostname()}"):
        RunLock(tmp_path / "mine").acquire()
    first.release()


def test_another_hosts_lock_without_slurm_to_ask_is_kept(tmp_path, slurm):
    slurm(None)  # squeue absent: whether job 4242 runs is unknown
    write_lock(tmp_path, slurm_job="4242")
    with pytest.raises(RunDirLocked, match="Slurm job 4242"):
        RunLock(tmp_path).acquire()


def test_in_a_container_the_batch_hosts_job_states_decide(tmp_path, slurm, monkeypatch, capsys):
    """No squeue in the container: ``ARMOR_SLURM_JOB_STATES`` (written by slurm/armor.sbatch on
    the batch host) lists this user's jobs; a resubmitted job takes over the lock of one that
    ended, keeps that of one still running, and of another user's job knows nothing."""
    slurm(None)
    states = tmp_path / "job_states"
    states.write_text("4242 RUNNING\n5151 PENDING\n")
    monkeypatch.setenv("ARMOR_SLURM_JOB_STATES", str(states))
    write_lock(tmp_path, slurm_job="4242", uid=os.getuid())
    with pytest.raises(RunDirLocked, match="Slurm job 4242"):
        RunLock(tmp_path).acquire()
    write_lock(tmp_path, slurm_job="4241", uid=os.getuid())  # not listed: ended
    RunLock(tmp_path).acquire().release()
    assert "Slurm job 4241 is no longer running" in capsys.readouterr().out
    write_lock(tmp_path, slurm_job="4241", uid=os.getuid() + 1)  # another user's job: unknown
    with pytest.raises(RunDirLocked, match="Slurm job 4241"):
        RunLock(tmp_path).acquire()


def test_a_zombie_holder_is_taken_over(tmp_path, slurm, capsys):
    """A driver killed with its ``armor`` parent waits, a zombie, until init reaps it: its lock
    is stale at once (the next start of the run must not be refused meanwhile)."""
    slurm(None)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            pass  # exited, not reaped: the zombie
        write_lock(tmp_path, pid=child.pid, host=socket.gethostname(),
                   start_ticks=process_start_ticks(child.pid))  # fmt: skip
        RunLock(tmp_path).acquire().release()
        assert f"pid {child.pid} is no longer running" in capsys.readouterr().out
    finally:
        child.wait()
