"""e2e tier: the driver and Ray's control plane are watched too (``cli/supervise.py``,
``cli/driver_watch.py``, ``orchestration/run/control_plane.py``), on one run directory of the
tiny config with the default settings:

1. SIGSTOP of the driver once step 3's anchor file is written (the step is under way; its
   checkpoint is step 2's): the ``armor train`` parent ends it within the deadline of its
   phase (learned from the run's steps, printed as ``driver deadline: step Ns``), names it,
   kills every process of the run and exits 75.
2. ``--resume auto``, SIGSTOP of the driver once it says it starts (``armor train: starting``:
   the run directory is its own, Ray is being started) and a SIGTERM to the process group (a
   preemption while the driver cannot act): exit 75 within ``orchestration.stop_wait_s``
   (lowered to 5 s) of the signal, long before the phase's deadline (its first start-up
   waits the cap); nothing of the run left.
3. ``--resume auto`` and SIGSTOP of the run's raylet once step 3's anchor file is written (a
   frozen node): the driver's probe hears
   from the GCS that the node is dead (its health checks, tightened for the run's own head),
   the parent names the raylet and its node and exits 75; nothing of the run left. (The
   actors call each other without the raylet: the run may reach step 4 meanwhile.)
4. ``--resume auto`` completes the run; every step's metrics equal the uninterrupted run's
   (timings excepted).

The three exits 75 have three causes: no requeue loop (``requeues.jsonl`` holds them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from megatron_armor.cli.supervise import process_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_runs import CACHED, Run  # noqa: E402
from process_group import raylet_pids  # noqa: E402
from test_faults_e2e import (  # noqa: E402
    anchor_file,
    assert_metrics_equal,
    wait_until_no_process_left,
)

pytestmark = pytest.mark.e2e
NAME = "driver_watched"
SLACK_S = 25  # the parent's poll, the kill and its wait, the exit, on a loaded machine


def stop(pid: int) -> None:
    """SIGSTOP, and until it took effect (``T`` in ``/proc/PID/stat``): a signal sent
    meanwhile would be taken first."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while process_state(pid)[0] != "T":
        assert time.monotonic() < deadline, process_state(pid)
        time.sleep(0.01)


def driver_pid(run: Run) -> int:
    """The driver: the only child of the ``armor train`` parent."""
    path = Path(f"/proc/{run.proc.pid}/task/{run.proc.pid}/children")
    (pid,) = [int(p) for p in path.read_text().split()]
    return pid


def resumed(out_dir: Path, tiny_dir: Path, *overrides: str) -> Run:
    """The next start of the run, once the killed start's anchor file of step 3 is gone (no
    checkpoint holds that step)."""
    run = Run(out_dir, NAME, tiny_dir, *CACHED, *overrides)
    anchor_file(run.run_dir, 3).unlink(missing_ok=True)
    return run


def ended(run: Run, timeout: float) -> tuple[int, float, str]:
    """``(exit code, seconds from now, the whole log)``, once no process of the run is left."""
    start = time.monotonic()
    code = run.proc.wait(timeout=timeout)
    took = time.monotonic() - start
    wait_until_no_process_left(run.ray_tmp, 60, run.output)
    run.cleanup()
    return code, took, Path(run.log.name).read_text()


@pytest.mark.timeout(1500)
def test_a_stopped_driver_or_raylet_ends_in_a_named_exit_75_and_the_run_resumes_exactly(
    reference_run, tiny_dir, out_dir
):
    run = Run(out_dir, NAME, tiny_dir, *CACHED)
    run.wait_for(anchor_file(run.run_dir, 3).is_file)
    deadlines = re.findall(r"driver deadline: step (\d+)s", run.output())
    pid = driver_pid(run)
    stop(pid)
    code, took, text = ended(run, 300)
    assert code == 75, text[-4000:]
    assert deadlines and took < int(deadlines[-1]) + SLACK_S, (took, deadlines)
    assert f"armor train: the driver (pid {pid}) made no progress for " in text, text[-3000:]
    assert f"in phase step of step 3, past its deadline of {deadlines[-1]}s" in text
    assert "killed the driver and the " in text and "uninterruptible sleep" not in text

    run = resumed(out_dir, tiny_dir, "orchestration.stop_wait_s=5")
    run.wait_for(lambda: "armor train: starting" in run.text())
    stop(driver_pid(run))
    run.signal_group(signal.SIGTERM)
    code, took, text = ended(run, 300)
    assert code == 75 and took < 5 + SLACK_S, (code, took, text[-3000:])
    assert "in phase start of step 0, SIGTERM arrived and the driver did not move within " in text
    assert "orchestration.stop_wait_s=5s" in text

    run = resumed(out_dir, tiny_dir)
    run.wait_for(lambda: anchor_file(run.run_dir, 3).is_file() and raylet_pids(run.ray_tmp))
    (raylet,) = raylet_pids(run.ray_tmp)
    stop(raylet)
    code, took, text = ended(run, 300)
    assert code == 75, text[-4000:]
    assert "armor train: lost Ray's raylet of node " in text and "the GCS marked it dead" in text
    print(f"a stopped raylet: exit 75 {took:.0f}s after the stop")

    last = resumed(out_dir, tiny_dir)
    assert last.wait() == 0, last.output()
    assert_metrics_equal(last.run_dir, reference_run)
    rows = [json.loads(x) for x in (last.run_dir / "requeues.jsonl").read_text().splitlines()]
    assert [(r["step"], r["cause"], r["signal"]) for r in rows[:2]] == [
        (3, "the driver stalled in phase step", False),
        (0, "the driver stalled in phase start", True),
    ], rows
    # the actors answer the driver without the raylet: the run may reach step 4 meanwhile
    assert rows[2]["step"] in (3, 4) and rows[2]["cause"] == "lost Ray's raylet", rows
