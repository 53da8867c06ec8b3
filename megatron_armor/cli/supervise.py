"""The parent of a training driver: a driver that stops answering, or a lost Ray control plane,
ends in a named line and exit 75; an exit 75 that keeps coming back ends the requeues.

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
- The driver is watched (``driver_watch.py``): it reports its phases and a heartbeat through
  the pipe, and a driver whose main loop does not advance within its phase's learned
  deadline (or within ``orchestration.stop_wait_s`` of a stop signal), or that reports a part
  of Ray's control plane lost (``orchestration/run/control_plane.py``: a frozen raylet or
  GCS), is named, killed with every process it started (:func:`end_driver`; a process in
  uninterruptible sleep is named and left) and this process exits 75.
- Each exit 75 goes into the run's ``requeues.jsonl``; the ``ARMOR_REQUEUE_REPEATS``-th in a
  row at the same step with the same cause exits 70 instead, a code the batch script does not
  requeue (``orchestration/run/requeue_history.py``).

``ARMOR_SUPERVISE=0`` runs the driver in this process, with no parent to name a lost control plane.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_armor import env_settings
from megatron_armor.cli.driver_watch import DriverWatch
from megatron_armor.orchestration.run import requeue_history
from megatron_armor.supervisor_pipe import ENV, SIGNAL_CAUSE

EXIT_REQUEUE = 75
SHIELDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""The run's stop signals (``ray_node.SHIELDED``): the driver checkpoints on them."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
             signal.SIGQUIT)  # fmt: skip
PR_SET_PDEATHSIG = 1
POLL_S = 1.0  # how often the parent looks at the driver's messages and deadline
PARENT_GAP_S = 10.0  # a look this late: the parent itself was stopped, not the driver
KILL_WAIT_S = 10.0  # how long SIGKILLed processes get to go
LOST = (
    ("The connection to the plasma store is failed", "raylet",
     "Ray's raylet (the driver's connection to its node's raylet and object store failed)"),
    ("Failed to connect to GCS within", "GCS",
     "Ray's GCS (the driver could not reach it within RAY_gcs_rpc_server_reconnect_timeout_s)"),
)  # fmt: skip
"""Ray's own last words in the driver's log, the part of Ray lost and what they mean."""


def wanted(argv: list[str] | None, commands: tuple[str, ...]) -> bool:
    """Supervise a process entry (``argv`` None) of ``commands``, unless this is already the
    driver or ``ARMOR_SUPERVISE=0``."""
    args = sys.argv[1:] if argv is None else argv
    return (argv is None and bool(args) and args[0] in commands and ENV not in os.environ
            and env_settings.value("ARMOR_SUPERVISE") != "0")  # fmt: skip


def supervise(args: list[str], command: list[str] | None = None) -> int:
    """Run ``armor ARGS`` (or ``command``) as a child, pass signals on, watch it, and return
    its exit code (see the module's docstring).

    The child starts with :data:`SHIELDED` blocked (a signal mask is inherited): one of them
    sent while its interpreter starts waits, pending, until the driver's handler is in place
    (``ray_node.held_stop_signals`` takes over from its first line, ``StopSignal.guarded``
    unblocks them), instead of ending it by its default action before it can checkpoint."""
    child: list[subprocess.Popen] = []
    pending: list[int] = []
    watch = DriverWatch(time.monotonic())

    def forward(signum, frame) -> None:
        if signum in SHIELDED:
            watch.stop_signal(signal.Signals(signum).name, time.monotonic())
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
        return watch_driver(args[0], child[0], MessageReader(read_end), watch)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def watch_driver(command: str, process: subprocess.Popen, reader: MessageReader,
                 watch: DriverWatch) -> int:  # fmt: skip
    """Read the driver's messages until it exits; end it when it stalls or reports a lost
    part of Ray. This process's exit code, a stopped requeue loop included."""
    last = time.monotonic()
    while process.poll() is None:
        reader.wait(process, POLL_S)
        now = time.monotonic()
        if now - last > PARENT_GAP_S:
            watch.parent_was_stopped(now)
        last = now
        for key, value in reader.read():
            for line in watch.receive(key, value, now):
                print(line, flush=True)
        part, _, lost = reader.messages.get("lost", "").partition(" ")
        stall = None if lost else watch.overdue(now)
        if lost or stall:
            end_driver(command, process, f"lost {lost}" if lost else stall.describe(process.pid))
            cause = f"lost Ray's {part}" if lost else stall.cause
            return after_requeue(command, reader.close(), watch, cause)
    messages = reader.close()
    code = outcome(command, process.pid, process.returncode, messages)
    if code != EXIT_REQUEUE:
        return code
    part = lost_part(driver_log_text(messages.get("ray_logs", ""), process.pid))
    cause = messages.get("cause") or (f"lost Ray's {part}" if part else "unknown")
    return after_requeue(command, messages, watch, cause)


class MessageReader:
    """The driver's ``key value`` lines (``supervisor_pipe.tell_supervisor``), read without
    blocking as they come: a process the driver started may hold the pipe open."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd, self.buffer, self.open = fd, b"", True
        self.messages: dict[str, str] = {}  # the last of each key

    def wait(self, process: subprocess.Popen, timeout: float) -> None:
        """Until the pipe has data, ``process`` ended (once the pipe is closed) or
        ``timeout`` seconds passed."""
        if self.open:
            select.select([self.fd], [], [], timeout)
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def read(self) -> list[tuple[str, str]]:
        """The whole lines that came since the last call, in order."""
        while self.open:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            self.open = bool(chunk)
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        pairs = [line.decode(errors="replace").partition(" ")[::2] for line in lines]
        self.messages.update(pairs)
        return pairs

    def close(self) -> dict[str, str]:
        """Read what is left, close the pipe; the last message of each key."""
        self.read()
        os.close(self.fd)
        return self.messages


def end_driver(command: str, process: subprocess.Popen, reason: str) -> None:
    """SIGKILL of the driver and every process it started (Ray's local head, the actors,
    their servers: found before any is killed); a process in uninterruptible sleep, which no
    signal ends before its I/O returns, is named and left behind."""
    from megatron_armor.orchestration.actors.process_trees import kill_trees

    pids = kill_trees([process.pid])
    try:
        process.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    left = still_running(pids, KILL_WAIT_S)
    started = f"{len(pids) - 1} process{'es' if len(pids) != 2 else ''}"
    print(f"armor {command}: {reason}: killed the driver and the {started} it started; "
          f"exiting {EXIT_REQUEUE} for a requeue, resume with --resume auto (the newest "
          "complete checkpoint)", file=sys.stderr, flush=True)  # fmt: skip
    for line in left_behind(left):
        print(f"armor {command}: {line}", file=sys.stderr, flush=True)


def still_running(pids: list[int], timeout: float) -> list[tuple[int, str, str]]:
    """``(pid, state, name)`` of ``pids`` still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [(pid, *state) for pid in pids if (state := process_state(pid))[0] not in "ZX"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def process_state(pid: int) -> tuple[str, str]:
    """``(state letter, name)`` from ``/proc/PID/stat`` (``("X", "")``: gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X", ""
    name = text[text.find("(") + 1 : text.rfind(")")]
    return text.rsplit(")", 1)[1].split()[0], name


def left_behind(left: list[tuple[int, str, str]]) -> list[str]:
    """One line per process a SIGKILL did not end: in uninterruptible sleep (``D``: waiting
    in the kernel, on a hung network file system or device) it ends when its I/O returns."""
    return [f"pid {pid} ({name}) is still alive in uninterruptible sleep (state D: waiting in "
            "the kernel, e.g. on a hung file system); it ends when its I/O returns, exiting "
            "without it" if state == "D" else
            f"pid {pid} ({name}) is still alive (state {state}) after SIGKILL; exiting without it"
            for pid, state, name in left]  # fmt: skip


def after_requeue(command: str, messages: dict[str, str], watch: DriverWatch, cause: str) -> int:
    """75, recorded in the run's history of requeues; 70 when it is the same at the same
    step for the ``ARMOR_REQUEUE_REPEATS``-th time in a row (``requeue_history.py``)."""
    run_dir = messages.get("run_dir")
    if not run_dir or not Path(run_dir).is_dir():
        return EXIT_REQUEUE
    signalled = watch.stop_at is not None or cause == SIGNAL_CAUSE
    count = requeue_history.record_exit(Path(run_dir), watch.step, cause, signalled)
    limit = env_settings.value("ARMOR_REQUEUE_REPEATS") or requeue_history.DEFAULT_REPEATS
    if count < limit:
        return EXIT_REQUEUE
    message = requeue_history.loop_message(Path(run_dir), watch.step, cause, count, limit)
    print(f"armor {command}: {message}", file=sys.stderr, flush=True)
    return requeue_history.EXIT_REQUEUE_LOOP


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
    return next((what for words, _, what in LOST if words in log_text), "")


def lost_part(log_text: str) -> str:
    """``raylet`` or ``GCS``: the part of Ray the driver lost, by Ray's last words."""
    return next((part for words, part, _ in LOST if words in log_text), "")


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
