"""A Ray node that the stop signals do not reach, so the driver can checkpoint after one.

Slurm signals every process of a job on preemption or ``scancel --signal=TERM --full``, and a
shell signals a whole process group; a Ray GCS or raylet that receives that SIGTERM exits,
and the driver then cannot save. So every Ray node the project starts runs as

    python -m megatron_armor.orchestration.actors.ray_node [--parent PID] -- ray start --block ARGS...

which blocks :data:`SHIELDED` (SIGTERM, SIGINT, SIGUSR1) in its signal mask and runs the
command as a child in a new session. A blocked mask is inherited through fork and exec, so the
GCS, the raylet, the workers and our actors (and the processes they start) keep running while
the driver, the one process that handles those signals, finishes the step and writes the
checkpoint. :data:`STOP` (SIGUSR2) stops the node: SIGKILL to the child's process group, which
holds every Ray process of the node (a SIGTERM first would be pointless: it is blocked in all
of them). With ``--parent PID`` the node also stops when that process dies
(``PR_SET_PDEATHSIG``), so a ``kill -9`` of the driver leaves no Ray behind.

:class:`LocalRayHead` is the single-node head a driver without ``orchestration.ray_address``
starts for itself (in a new session: a signal to the driver's process group does not reach
it), stopped with :data:`STOP` when the run ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_armor.net import free_port
from megatron_armor.supervisor_pipe import advance

SHIELDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP = signal.SIGUSR2
READY_LINE = "Ray runtime started"
STOP_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1


@contextmanager
def held_stop_signals() -> Iterator[None]:
    """Block :data:`SHIELDED` in the calling thread and the threads it starts meanwhile (around
    ``armor train``, from its first line): one that arrives while the run imports and loads
    its config waits, pending, until ``StopSignal.guarded`` hands it to the run's handler
    (exit 75 before the first step) instead of ending the process by its default action. The
    previous mask is back at the end (a command that failed before its run started)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """In a Ray actor (its ``__init__``): ignore :data:`SHIELDED`. The inherited mask is not
    enough there: on Slurm's job termination (SIGTERM to every process of the job) the actors
    still ran Ray's worker SIGTERM handler, which exits. The driver acts on these signals."""
    if threading.current_thread() is threading.main_thread():
        for sig in SHIELDED:
            signal.signal(sig, signal.SIG_IGN)


def stop_with_parent(parent: int) -> None:
    """Receive :data:`STOP` when ``parent`` dies; stop now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(STOP), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), STOP)


def run_shielded(command: list[str], parent: int | None = None) -> int:
    """Run ``command`` with :data:`SHIELDED` blocked until it exits or :data:`STOP` arrives;
    returns its exit code (0 when stopped)."""
    child: subprocess.Popen | None = None
    stopped = False

    def stop(signum, frame) -> None:
        nonlocal stopped
        stopped = True
        if child is not None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    signal.signal(STOP, stop)
    signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    if parent is not None:
        stop_with_parent(parent)
    if not stopped:
        child = subprocess.Popen(command, start_new_session=True)
    if stopped:  # STOP arrived while the child was being started
        stop(STOP, None)
    code = child.wait() if child is not None else 0
    return 0 if stopped else code


def main(argv: list[str]) -> int:
    parent = None
    if argv[:1] == ["--parent"]:
        parent, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit(
            "usage: python -m megatron_armor.orchestration.actors.ray_node [--parent PID] -- CMD..."
        )
    return run_shielded(argv, parent)


class LocalRayHead:
    """A single-node Ray head in its own session, for one driver; :meth:`stop` ends it."""

    def __init__(
        self, args: list[str], log_path: Path, timeout_s: float, node_ip: str | None = None
    ) -> None:
        """``node_ip`` (e.g. the loopback address) is the head's node IP; Ray's own choice
        (the node's network address) when None."""
        import ray._private.services as services

        ip = node_ip or services.get_node_ip_address()
        port = free_port()
        self.address = f"{ip}:{port}"
        self.log_path = log_path
        ray_start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--head",
                     f"--port={port}", f"--node-ip-address={ip}", "--disable-usage-stats",
                     *args]  # fmt: skip
        cmd = [sys.executable, "-m", __name__, "--parent", str(os.getpid()), "--", *ray_start]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = log_path.stat().st_size if log_path.exists() else 0  # appended to
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        """Until ``ray start`` reports the runtime started (bounded; fails if it exits)."""
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in self._log_text():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the local Ray head exited with code {self.process.returncode}; see "
                    f"{self.log_path}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the local Ray head did not start in {timeout_s:.0f}s; see {self.log_path} "
                    "or raise orchestration.ray_init_timeout_s"
                )
            advance()  # a bounded wait: progress for the driver's parent (cli/driver_watch.py)
            time.sleep(0.2)

    def _log_text(self) -> str:
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """:data:`STOP`, then SIGKILL of its session if it has not exited within ``timeout_s``."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(STOP)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
