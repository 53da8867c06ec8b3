"""``slurm/lib/detached_srun.py``: srun started outside the batch shell's process tree and
process group, so that no job-wide signal reaches it (srun turns SIGTERM into a SIGKILL of its
step); its keeper drops SIGTERM/SIGINT, passes SIGUSR1/SIGUSR2 on, exits with its code, and
takes it down when killed itself. A shell script stands in for srun. Tier: unit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

KEEPER = Path(__file__).resolve().parents[2] / "slurm" / "lib" / "detached_srun.py"
STEP = """
echo "$$ $PPID $(ps -o pgid= -p $$ | tr -d ' ')" > "$1/started"
trap 'echo USR1 >> "$1/signals"' USR1
trap 'echo TERM >> "$1/signals"' TERM
while [ ! -e "$1/finish" ]; do sleep 0.05; done
exit 7
"""


def start(tmp_path: Path) -> subprocess.Popen:
    """The keeper as the sbatch files start it: SIGTERM/SIGINT ignored from its first line."""
    return subprocess.Popen(
        ["bash", "-c", 'trap "" TERM INT; exec "$@"', "keeper", sys.executable, str(KEEPER),
         "--", "bash", "-c", STEP, "step", str(tmp_path)],
        start_new_session=True,
    )  # fmt: skip


def wait_for(path: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)
    return path.read_text()


def test_the_step_is_detached_signals_pass_or_drop_and_its_code_is_the_keepers(tmp_path):
    keeper = start(tmp_path)
    pid, ppid, pgid = (int(x) for x in wait_for(tmp_path / "started").split())
    assert ppid != keeper.pid and pgid != os.getpgid(keeper.pid)  # outside tree and group
    keeper.send_signal(signal.SIGTERM)  # a job-wide SIGTERM: dropped
    keeper.send_signal(signal.SIGUSR1)  # the driver's checkpoint request: passed on
    assert wait_for(tmp_path / "signals") == "USR1\n"
    (tmp_path / "finish").touch()
    assert keeper.wait(timeout=60) == 7


def test_a_killed_keeper_takes_its_step_down(tmp_path):
    keeper = start(tmp_path)
    pid = int(wait_for(tmp_path / "started").split()[0])
    keeper.kill()  # SIGKILL at the end of a teardown's grace
    keeper.wait(timeout=30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()
