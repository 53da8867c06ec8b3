"""Run a command that dies with the process that started it, even when that one is SIGKILLed.

``python -m megatron_armor.with_parent PARENT_PID COMMAND...`` asks the kernel for a SIGKILL when
its parent dies (``PR_SET_PDEATHSIG``), checks the parent is still ``PARENT_PID`` (it may have
died before the request), then replaces itself with ``COMMAND`` (the request survives the
``exec``; the pid, the process group and ``/proc/PID/cmdline`` are the command's own).

A rollout worker starts its SGLang servers through it (``rollout/sglang/launch.py``): the
servers lead sessions of their own, so a ``kill -9`` of the run's process group or of the worker
would otherwise leave them holding their GPU memory and ports. SGLang's scheduler and detokenizer
already end with the server process. Linux only; elsewhere the command runs unchanged.

The kernel sends the signal when the *thread* that forked the child ends: a Ray actor's method
threads live as long as the actor, which is the lifetime wanted here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def command_with_parent(command: list[str], parent: int | None = None) -> list[str]:
    """``command`` wrapped so that it dies with ``parent`` (default: this process)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    pid = os.getpid() if parent is None else parent
    return [sys.executable, "-m", "megatron_armor.with_parent", str(pid), *command]


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m megatron_armor.with_parent PARENT_PID COMMAND...")
    parent, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request above
        os.kill(os.getpid(), signal.SIGKILL)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
