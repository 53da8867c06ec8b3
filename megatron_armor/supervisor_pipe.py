"""The driver's two messages to the ``armor`` process that runs it (``cli/supervise.py``).

``armor train`` / ``armor pipeline`` run the driver as a child so that a driver Ray's C++ core
ends without a word (its raylet or GCS lost) still ends in a named line and exit 75. The
child tells its parent, through a pipe, where Ray writes its logs (once connected) and the
exit code it leaves with (through Python); a child that dies without the second message was
ended below Python, and Ray's log says why. Bottom layer (stdlib only): the CLI and the
orchestration both write here.
"""

from __future__ import annotations

import os

ENV = "ARMOR_SUPERVISOR"
"""``PARENT_PID:FD`` in the driver's environment: the pipe to the supervising parent."""

_pipe: int | None = None


def adopt_pipe() -> int | None:
    """In the driver, first thing: take the pipe out of the environment (the processes the
    driver starts, Ray's among them, must not inherit it) and keep it if the parent named in
    it is ours; that parent's pid (``None``: not supervised)."""
    global _pipe
    value = os.environ.pop(ENV, "")
    parent, _, fd = value.partition(":")
    if not (parent.isdigit() and fd.isdigit() and int(parent) == os.getppid()):
        return None
    _pipe = int(fd)
    return int(parent)


def tell_supervisor(key: str, value: object) -> None:
    """Send ``key value`` to the parent (nothing without one; best effort)."""
    if _pipe is None:
        return
    try:
        os.write(_pipe, f"{key} {value}\n".encode())
    except OSError:
        pass
