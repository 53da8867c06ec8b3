"""The parent of a training driver: a lost Ray control plane ends in a named line and exit 75.

When the raylet or the GCS of a run dies, Ray's C++ core ends the driver process itself
(``_exit(1)`` after "The connection to the plasma store is failed" or "Failed to connect to
GCS within N seconds" in Ray's driver log): no Python handler runs, nothing is printed, and
exit 1 is not a code a scheduler requeues. So ``armor train`` and ``armor pipeline`` run the
driver as a child (the same command line: ``sys.orig_argv``, so an entry point that wraps
``megatron_armor.cli.main`` runs its own code in the driver too; in the same process group)
and wait for it:

- SIGTERM, SIGINT, SIGUSR1 (and SIGUSR2, SIGHUP, SIGQUIT) sent to this process are passed to
  the driver. A signal to the whole process group reaches the driver twice: the run's
  handler records a stop once, whatever the count (``run_state.StopSignal``). The driver
  starts with SIGTERM, SIGINT and SIGUSR1 blocked, so one that comes before its handler is in
  place waits for it.
- The driver's exit code is this process's; a driver a signal killed kills this process by
  the same signal (a scheduler sees ``128 + N``). The code the driver reported when
  it left through Python wins over a death after it (a crash of Ray's teardown).
- A driver that died without reporting its exit (``supervisor_pipe``) while Ray's log names the
  lost connection: ``armor train: lost Ray's raylet ...`` and exit 75, which ``--resume auto``
  continues from the newest complete checkpoint.
- The driver dies with this process (``PR_SET_PDEATHSIG``: SIGKILL): a ``kill -9`` of ``armor``
  leaves no driver behind.

``ARMOR_SUPERVISE=0`` runs the driver in this process, with no parent to name a lost control plane.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_armor.supervisor_pipe import ENV

EXIT_REQUEUE = 75
SHIELDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""The run's stop signals (``ray_node.SHIELDED``): the driver checkpoints on them."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
             signal.SIGQUIT)  # fmt: skip
PR_SET_PDEATHSIG = 1
LOST = (
    ("The connection to the plasma store is failed",
     "Ray's raylet (the driver's connection to its node's raylet and object store failed)"),
    ("Failed to connect to GCS within",
     "Ray's GCS (the driver could not reach it within RAY_gcs_rpc_server_reconnect_timeout_s)"),
)  # fmt: skip
"""Ray's own last words in the driver's log and what they mean."""


def wanted(argv: list[str] | None, commands: tuple[str, ...]) -> bool:
    """Supervise a process entry (``argv`` None) of ``commands``, unless this is already the
    driver or ``ARMOR_SUPERVISE=0``."""
    args = sys.argv[1:] if argv is None else argv
    return (argv is None and bool(args) and args[0] in commands and ENV not in os.environ
            and os.environ.get("ARMOR_SUPERVISE", "1") != "0")  # fmt: skip


def supervise(args: list[str], command: list[str] | None = None) -> int:
    """Run ``armor ARGS`` (or ``command``) as a child, pass signals on, and return its exit
    code (see the module's docstring).

    The child starts with :data:`SHIELDED` blocked (a signal mask is inherited): one of them
    sent while its interpreter starts waits, pending, until the driver's handler is in place
    (``ray_node.held_stop_signals`` takes over from its first line, ``StopSignal.guarded``
    unblocks them), instead of ending it by its default action before it can checkpoint."""
    child: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum, frame) -> None:
        if child:
            child[0].send_signal(signum)
        else:
            pending.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    read_end, write_end = os.pipe()
    env = {**os.environ, ENV: f"{os.getpid()}:{write_end}"}
    command = command or [sys.executable, *sys.orig_argv[1:]]  # the same entry, flags and all
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
        try:
            child.append(subprocess.Popen(command, env=env, pass_fds=(write_end,)))
        finally:
            os.close(write_end)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one that came meanwhile: passed on
        for signum in pending:
            child[0].send_signal(signum)
        code = wait_for(child[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return outcome(args[0], child[0].pid, code, read_messages(read_end))


def wait_for(process: subprocess.Popen) -> int:
    """The child's return code (a forwarded signal interrupts the wait: wait again)."""
    while True:
        try:
            return process.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries it already
            continue


def read_messages(fd: int) -> dict[str, str]:
    """``key value`` lines the driver wrote (``supervisor_pipe.tell_supervisor``); the last of
    each key. Read without blocking: a process the driver started may hold the pipe open."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    messages = {}
    for line in data.decode(errors="replace").splitlines():
        key, _, value = line.partition(" ")
        messages[key] = value
    return messages


def outcome(command: str, pid: int, code: int, messages: dict[str, str]) -> int:
    """This process's exit code for a driver that returned ``code``: the code it reported (its
    run's verdict, given after the run closed: a crash of Ray's teardown or a signal after it
    does not turn a requeue or a success into a signal death); unreported, a lost control plane
    is named and turned into 75, and a driver killed by a signal kills this process by it."""
    reported = messages.get("exit")
    if reported is not None:
        if str(code) != reported:
            print(f"armor {command}: the driver (pid {pid}) ended with {code} after it exited "
                  f"{reported}: exiting {reported}", file=sys.stderr)  # fmt: skip
        return int(reported)
    lost = lost_control_plane(driver_log_text(messages.get("ray_logs", ""), pid))
    if lost:
        print(f"armor {command}: lost {lost}; the driver (pid {pid}) was ended by Ray "
              f"(exit {code}): exiting {EXIT_REQUEUE} for a requeue, resume with "
              "--resume auto (the newest complete checkpoint)", file=sys.stderr)  # fmt: skip
        return EXIT_REQUEUE
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default action does not end the process
    return code


def driver_log_text(logs_dir: str, pid: int) -> str:
    """The end of Ray's core-worker log of the driver ``pid`` (``python-core-driver-*_PID.log``
    in Ray's session logs directory), or ``""``."""
    if not logs_dir:
        return ""
    texts = []
    for path in Path(logs_dir).glob(f"python-core-driver-*_{pid}.log"):
        try:
            with path.open("rb") as log:
                log.seek(max(path.stat().st_size - 65536, 0))
                texts.append(log.read().decode(errors="replace"))
        except OSError:
            continue
    return "\n".join(texts)


def lost_control_plane(log_text: str) -> str:
    """What the driver lost, by Ray's last words in its log; ``""`` if they are not there."""
    return next((what for words, what in LOST if words in log_text), "")


def die_with_parent(parent: int) -> None:
    """In the driver: SIGKILL when the supervising ``parent`` dies (``kill -9`` of the
    ``armor`` process ends the run, its driver included)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except AttributeError:  # not Linux: no parent-death signal
        return
    if prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
