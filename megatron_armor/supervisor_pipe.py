"""The driver's messages to the ``armor`` process that runs it (``cli/supervise.py``).

``armor train`` / ``armor pipeline`` run the driver as a child so that a driver that stops
answering, or one Ray's C++ core ends without a word (its raylet or GCS lost), still ends in a
named line and exit 75. The child tells its parent, through a pipe, one ``key value`` line at
a time:

- ``rule M Q FLOOR CAP STOP_WAIT``: the run's deadline settings (``orchestration.call_deadline_*``
  and ``stop_wait_s``), once its config is loaded;
- ``run_dir PATH``: the run directory (its exits 75 are kept there,
  ``orchestration/run/requeue_history.py``);
- ``phase STEP NAME``: the loop entered phase ``NAME`` of step ``STEP`` (``-``: a part of the
  process that is not watched, after the run);
- ``beat N``: once a second from a thread of its own, with :func:`advance`'s count: the beat
  needs the interpreter alive, a count that moves needs the main loop advancing;
- ``cause TEXT``: why the driver exits 75 (:data:`SIGNAL_CAUSE` for a stop signal);
- ``lost PART TEXT``: ``raylet`` or ``GCS`` of Ray's control plane no longer answers, and
  how (``orchestration/run/control_plane.py``);
- ``ray_logs PATH``: where Ray writes the driver's log, once connected;
- ``exit CODE``: the code it leaves with through Python (a child that dies without it was
  ended below Python, and Ray's log says why).

Bottom layer (stdlib only): the CLI and the orchestration both write here.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "ARMOR_SUPERVISOR"
"""``PARENT_PID:FD`` in the driver's environment: the pipe to the supervising parent."""
BEAT_S = 1.0
"""Seconds between two heartbeats of the driver."""
UNWATCHED = "-"
"""The phase of a driver that is done with its run (no deadline: a summary, an export)."""
SIGNAL_CAUSE = "signal"
"""The ``cause`` of an exit 75 after a stop signal (a preemption: never a requeue loop)."""

_pipe: int | None = None
_progress = 0  # the main loop's marks of progress (advance)
_step = 0  # the step of the last phase reported


def adopt_pipe() -> int | None:
    """In the driver, first thing: take the pipe out of the environment (the processes the
    driver starts, Ray's among them, must not inherit it), keep it if the parent named in it
    is ours and start the heartbeat; that parent's pid (``None``: not supervised)."""
    global _pipe
    value = os.environ.pop(ENV, "")
    parent, _, fd = value.partition(":")
    if not (parent.isdigit() and fd.isdigit() and int(parent) == os.getppid()):
        return None
    _pipe = int(fd)
    os.set_blocking(_pipe, False)  # a parent that does not read never blocks the driver
    threading.Thread(target=_beat, name="armor-heartbeat", daemon=True).start()
    return int(parent)


def tell_supervisor(key: str, value: object) -> None:
    """Send ``key value`` to the parent (nothing without one; best effort). A line is one
    ``write`` of less than ``PIPE_BUF`` bytes: lines of two threads never interleave."""
    if _pipe is None:
        return
    try:
        os.write(_pipe, f"{key} {value}\n".encode())
    except OSError:
        pass


def advance() -> None:
    """The driver's main loop made progress (a wait polled, a phase began)."""
    global _progress
    _progress += 1


def report_phase(phase: str, step: int | None = None) -> None:
    """The loop enters ``phase`` of ``step`` (the last step reported when None)."""
    global _step
    _step = _step if step is None else step
    tell_supervisor("phase", f"{_step} {phase}")
    advance()


def report_rule(multiple: float, q: float, floor_s: float, cap_s: float, stop_wait_s: float):
    """The run's deadline settings: the parent applies the rule of the call deadlines to the
    driver's phases, and ends a driver that does not move within ``stop_wait_s`` of a stop
    signal."""
    tell_supervisor("rule", f"{multiple:g} {q:g} {floor_s:g} {cap_s:g} {stop_wait_s:g}")


def _beat() -> None:
    while True:
        time.sleep(BEAT_S)
        tell_supervisor("beat", _progress)
