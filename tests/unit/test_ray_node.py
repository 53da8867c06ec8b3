"""The shielded Ray node launcher (``orchestration/actors/ray_node.py``) with a stand-in for
``ray start``: the stop signals are blocked in what it starts, SIGUSR2 kills that process group,
and a launcher whose parent is gone stops at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from megatron_armor.orchestration.actors.ray_node import SHIELDED, STOP

pytestmark = pytest.mark.unit

# Prints its blocked-signal mask and its child's pid, then waits (a `ray start --block` with a
# GCS underneath, in miniature).
NODE = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "mask = open('/proc/self/status').read().split('SigBlk:')[1].split()[0]\n"
    "print(mask, child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def launch(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_armor.orchestration.actors.ray_node", *args,
           "--", sys.executable, "-c", NODE]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` has exited (or is a zombie), waiting up to ``timeout_s`` for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "zombie" in f.read():
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_stop_signals_are_blocked_in_the_node_and_sigusr2_kills_all_of_it():
    node = launch()
    mask, grandchild = node.stdout.readline().split()
    blocked = int(mask, 16)
    assert all(blocked & (1 << (sig - 1)) for sig in SHIELDED), mask
    node.send_signal(signal.SIGTERM)  # blocked in the launcher too: it keeps running
    node.send_signal(STOP)
    assert node.wait(timeout=60) == 0  # stopped, not killed by the SIGTERM
    assert gone(int(grandchild))  # the whole process group went with it


def test_a_node_whose_parent_is_gone_stops_before_starting_anything():
    node = launch("--parent", "1")  # not its parent: as if the driver had already died
    assert node.wait(timeout=60) == 0
    assert node.stdout.read() == ""
