"""One writer per run directory: ``run_dir/.lock`` holds the writer's pid, host and start time.

The lock file is created with ``O_CREAT | O_EXCL`` (atomic, also on NFS v3+). A second run on
the same directory is refused with :class:`RunDirLocked`; a lock whose process is gone (same
host, pid not alive — e.g. after ``kill -9``) is stale and taken over. A lock from another
host cannot be checked from here: the error says how to remove it once that run is gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirLocked(RuntimeError):
    """Another live run writes this run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # half-written by a writer killed mid-create: treated as stale


def _is_stale(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    return not isinstance(pid, int) or not _pid_alive(pid)


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
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return True

    def acquire(self) -> RunLock:
        """Take the lock, replacing a stale one; raise :class:`RunDirLocked` when a live run
        holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock removed by two starters at once: retry the create
            if self._create():
                self.held = True
                return self
            holder = _read(self.path)
            if not _is_stale(holder):
                raise RunDirLocked(self._refusal(holder))
            print(f"{self.path}: taking over the stale lock of pid {holder.get('pid')} "
                  f"on {holder.get('host')} (no longer running)", flush=True)  # fmt: skip
            self.path.unlink(missing_ok=True)
        raise RunDirLocked(f"{self.path}: could not take the lock; another run is starting here")

    def _refusal(self, holder: dict) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
        return (
            f"{self.path.parent} is in use by another run (pid {holder.get('pid')} on "
            f"{holder.get('host')}, since {since}); two runs must not write one run directory: "
            "wait for it, stop it, or pick another run.name / run.output_dir. If that run is "
            f"gone (e.g. its node died), delete {self.path}"
        )

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held and _read(self.path).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False
