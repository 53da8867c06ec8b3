"""Helpers of the e2e tests for runs started in their own process group and Ray temp dir:
finding, waiting on and killing their processes, and the TCP ports those listen on."""

from __future__ import annotations

import os
import signal
import socket
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


def free_ports(count: int) -> list[int]:
    """Distinct free ports below the ephemeral range (Ray opens many sockets meanwhile)."""
    import random

    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20000, 30000)
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def actor_pids(ray_tmp: str, cls: str, env: str = "RAY_TMPDIR") -> list[int]:
    """Live processes of Ray actors of class ``cls`` (their title starts ``ray::cls``) whose
    environment holds ``env=ray_tmp``: by default the run whose Ray temp dir is ``ray_tmp``
    (``RAY_TMPDIR``); ``env="SLURM_JOB_ID"`` the actors of that Slurm job (its raylets, started
    by its srun steps, hand the variable on)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        mine = f"{env}={ray_tmp}".encode() in environ
        if mine and title.startswith(f"ray::{cls}".encode()) and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def run_pids(ray_tmp: str) -> list[int]:
    """Live processes (zombies left out) whose environment holds ``RAY_TMPDIR=ray_tmp``: every
    process of the run whose Ray temp dir is ``ray_tmp``, whatever its title."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"RAY_TMPDIR={ray_tmp}".encode() in environ and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def wait_until_no_run_process(ray_tmp: str, timeout: float, output: Callable[[], str]) -> None:
    """Until no process of the run is left: none has ``RAY_TMPDIR=ray_tmp`` in its environment
    (every process a run starts inherits it, also those whose command line does not name the
    temp dir, as the processes megatron-core's checkpoint writer starts); fail naming them."""
    deadline = time.monotonic() + timeout
    while left := run_pids(ray_tmp):
        assert time.monotonic() < deadline, f"{left} outlived the run:\n{output()}"
        time.sleep(0.2)


def raylet_pids(ray_tmp: str) -> list[int]:
    """The raylet processes of the run whose Ray temp dir is ``ray_tmp`` (never chosen by name:
    other runs on the machine have theirs)."""
    found = []
    for pid in run_pids(ray_tmp):
        try:
            binary = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if binary.endswith(b"/raylet"):
            found.append(pid)
    return found


def server_pids(port: int) -> list[int]:
    """Processes started with the arguments ``--port PORT`` (a server's, as the SGLang backend
    launches it: ``/proc/PID/cmdline`` separates arguments with NUL bytes)."""
    return pids_mentioning(f"--port\0{port}\0")


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


def wait_until_gone(text: str, timeout: float, output: Callable[[], str]) -> None:
    """Until no process mentions ``text`` on its command line (e.g. a run's Ray temp dir once
    its driver is gone); fail naming them after ``timeout``."""
    deadline = time.monotonic() + timeout
    while pids := pids_mentioning(text):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"processes {pids} still alive {timeout}s after the driver exited:\n{output()}"
            )
        time.sleep(0.2)


def wait_until(
    proc: subprocess.Popen, predicate: Callable[[], bool], timeout: float, output: Callable[[], str]
) -> None:
    """Poll ``predicate`` until it holds; fail if ``proc`` exits first or ``timeout`` passes.
    Polled every 10 ms: a signal meant for "the step whose anchor file just appeared" must land
    before that step's training (a fraction of a second on the tiny config) ends."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run exited {proc.returncode} early:\n{output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {timeout}s:\n{output()}")
        time.sleep(0.01)


def process_group_and_ray(pgid: int, ray_tmp: str) -> set[int]:
    """A run's processes: its process group ``pgid`` and every process under its Ray temp dir."""
    pids = set(pids_mentioning(ray_tmp))
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == pgid:
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def _decode(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (little-endian hex words) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listening_addresses(pids: set[int]) -> dict[str, int]:
    """``{"address:port": pid}`` of the TCP sockets in LISTEN state owned by ``pids`` (what
    ``ss -ltnp`` shows, read from /proc so the tests need no iproute2)."""
    owner = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owner:  # 0A = LISTEN
                addr, port = fields[1].split(":")
                found[f"{_decode(addr)}:{int(port, 16)}"] = owner[fields[9]]
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")
