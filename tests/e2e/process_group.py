"""Helpers of the e2e tests for runs started in their own process group and Ray temp dir."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def pids_mentioning(text: str) -> list[int]:
    """Processes (other than this one) whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def kill_leftovers(proc: subprocess.Popen, ray_tmp: str) -> None:
    """``kill -9`` of ``proc``'s process group and of every process under ``ray_tmp``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids_mentioning(ray_tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_until(
    proc: subprocess.Popen, predicate: Callable[[], bool], timeout: float, output: Callable[[], str]
) -> None:
    """Poll ``predicate`` until it holds; fail if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run exited {proc.returncode} early:\n{output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {timeout}s:\n{output()}")
        time.sleep(0.2)
