"""A server started through ``ManagedProcess`` dies with the process that started it, even when
that one is SIGKILLed (``megatron_armor/with_parent.py``); before, it led a session of its own
and outlived a ``kill -9`` of the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.unit

STARTER = """
import sys, time
from megatron_armor.rollout.sglang.launch import ManagedProcess
server = ManagedProcess(["sleep", "120"], "http://127.0.0.1:9/health")
server.start()
print(server.process.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int, within_s: float) -> bool:
    """``pid`` no longer runs (or is a zombie) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_dies_with_the_process_that_started_it_even_sigkilled():
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    try:
        server = int(starter.stdout.readline())
        deadline = time.monotonic() + 10  # the shim exec's into the command
        while time.monotonic() < deadline:
            with open(f"/proc/{server}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0] == b"sleep":
                    break
            time.sleep(0.05)
        with open(f"/proc/{server}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[:2] == [b"sleep", b"120"]  # the same pid, its own name
        assert os.getpgid(server) == server  # still the leader of its own session's group
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        assert gone(server, within_s=10)
    finally:
        starter.kill()
        starter.wait()


def test_a_parent_that_is_already_gone_ends_the_command_at_once():
    """The parent died before the request took effect: the command is not run."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_armor.with_parent", "1", "sh", "-c", "echo ran"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL and "ran" not in proc.stdout
