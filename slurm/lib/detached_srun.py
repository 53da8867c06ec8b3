#!/usr/bin/env python3
"""Run ``srun ...`` where no job-wide signal reaches it, so that a preemption cannot kill a step.

    python3 slurm/lib/detached_srun.py -- srun [OPTIONS] COMMAND...

srun turns a SIGTERM, SIGINT or SIGHUP it receives into a SIGKILL of its step (srun's signal
manager: "forcing job termination"), and when srun itself dies its shepherd kills the step.
``scancel --signal=TERM --full`` and a preemption signal the processes of the batch step,
where every srun of the job runs: all of its process tree with ``ProctrackType=
proctrack/linuxproc``, its process group with ``proctrack/pgid`` (``proctrack/cgroup`` signals
only the batch shell itself). An srun there would SIGKILL the Ray node or the driver it runs
before the driver has written its checkpoint. Stdlib only: it runs on the batch host, outside
any container.

This process, the *keeper* (the batch shell tracks it by PID, as it would srun, and starts it
with SIGTERM and SIGINT ignored, so that one arriving while Python starts is lost too), starts srun
through a double fork in a new session: srun's parent is then init, outside the batch step's
process tree and process group. The keeper

- ignores SIGTERM and SIGINT: the step's own tasks get Slurm's signals directly;
- passes SIGUSR1 (the driver's checkpoint request) and SIGUSR2 (a Ray node's stop) to srun,
  which forwards them to its step;
- exits with srun's exit code (128 + n when a signal ended srun) once srun has exited;
- when it is killed itself (SIGKILL after a teardown's grace), srun is SIGKILLed too (the
  process between them watches the keeper), and srun's shepherd then kills the step.

Where the cluster tracks processes by cgroup, srun stays in the job's cgroup and Slurm's final
SIGKILL of the job reaches it as before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)
IGNORED = (signal.SIGTERM, signal.SIGINT)


def exit_code(returncode: int) -> int:
    """A shell's exit code for a ``Popen.returncode`` (128 + n for a signal n)."""
    return 128 - returncode if returncode < 0 else returncode


def report(fd: int, line: str) -> None:
    """Write ``line`` to the keeper (gone, when it was killed: nothing to tell then)."""
    try:
        os.write(fd, f"{line}\n".encode())
    except OSError:
        pass


def run_detached(command: list[str], report_fd: int, keeper_fd: int) -> None:
    """In the detached process: run ``command``, write its pid and then its exit code to
    ``report_fd``; SIGKILL it when ``keeper_fd`` reaches end of file (the keeper died)."""
    for sig in (*FORWARDED, *IGNORED):
        signal.signal(sig, signal.SIG_DFL)
    try:
        child = subprocess.Popen(command)
    except OSError as err:
        print(f"detached_srun: cannot run {command[0]}: {err}", file=sys.stderr, flush=True)
        report(report_fd, "0")
        report(report_fd, "127")
        os._exit(127)
    report(report_fd, str(child.pid))

    def kill_when_keeper_dies() -> None:
        while os.read(keeper_fd, 1):
            pass
        if child.poll() is None:
            child.kill()

    threading.Thread(target=kill_when_keeper_dies, daemon=True).start()
    code = exit_code(child.wait())
    report(report_fd, str(code))
    os._exit(code)


def start_detached(command: list[str]) -> int:
    """Double-fork ``command`` into a new session; returns the read end of its report pipe."""
    report_r, report_w = os.pipe()
    keeper_r, keeper_w = os.pipe()  # the keeper holds keeper_w open until it dies
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os.close(report_r)
        os.close(keeper_w)
        run_detached(command, report_w, keeper_r)
    os.close(report_w)
    os.close(keeper_r)
    os.waitpid(middle, 0)
    return report_r


def keep(command: list[str]) -> int:
    """The keeper: start ``command`` detached, pass :data:`FORWARDED` signals to it, return its
    exit code."""
    pending: list[int] = []
    target = {"pid": 0}

    def forward(signum, frame) -> None:
        if target["pid"] > 0:
            os.kill(target["pid"], signum)
        else:
            pending.append(signum)

    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    report = os.fdopen(start_detached(command), "r")
    first = report.readline()
    target["pid"] = int(first) if first.strip() else 0
    for sig in pending:
        forward(sig, None)
    last = report.readline()
    if not last.strip():
        print(f"detached_srun: {command[0]} ended without an exit code", file=sys.stderr)
        return 1
    return int(last)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: detached_srun.py -- srun [OPTIONS] COMMAND...")
    return keep(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
