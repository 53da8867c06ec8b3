"""e2e tier: stop signals to the whole process group of ``armor train``, as a shell, a terminal
(Ctrl-C) or a local launcher sends them, at three moments of one run:

1. SIGTERM to the group while step 2 runs (once its anchor file is written): the step
   finishes, its checkpoint is written, the exit message names the step on disk, exit 75. Ray's processes run in their own session and
   block the stop signals (``orchestration/ray_node.py``), so the group signal reaches only the
   driver; they are gone once the driver has exited.
2. SIGTERM to the group during start-up of the resumed run: exit 75 before any step, nothing
   written (no new checkpoint, no temp directory, ``metrics.jsonl`` untouched).
3. SIGINT to the group while step 3 runs: the same as SIGTERM, no traceback.
4. ``kill -9`` of the group while step 4 runs: the Ray node stops with its parent.

A last ``--resume auto`` completes the run (from the checkpoint of step 3), and every step's metrics equal the uninterrupted
reference run's (timings excepted). The run waits on its own log lines, never on a clock.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics, without_wall_clock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_runs import CACHED, Run  # noqa: E402

pytestmark = pytest.mark.e2e

STARTING = "armor train: starting"


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def interrupt(run: Run, sig: int, ready) -> str:
    """``sig`` to the run's process group once ``ready()``; the run's output after it exited
    75 and left no Ray process behind."""
    run.wait_for(ready)
    run.signal_group(sig)
    code = run.proc.wait(timeout=300)
    out = run.output()
    assert code == 75, out
    run.wait_for_exit_of_ray(timeout=60)  # SIGKILLed by the driver's stop of its Ray head
    run.cleanup()
    return out


@pytest.mark.timeout(1500)
def test_group_signals_checkpoint_exit_75_and_resume_exactly(reference_run, tiny_dir, out_dir):
    name = "signalled"
    run_dir = out_dir / name
    mid_step = lambda step: (run_dir / "anchors" / f"step_{step:06d}.jsonl").is_file  # noqa: E731
    overrides = (*CACHED, "run.ckpt_every=100")  # checkpoints only on the signal and at the end

    first = Run(out_dir, name, tiny_dir, *overrides)
    out = interrupt(first, signal.SIGTERM, mid_step(2))  # after step 2's rollout
    assert "SIGTERM: checkpoint of step 2 written" in out, out
    assert checkpoint_steps(run_dir) == [2], out

    metrics_before = (run_dir / "metrics.jsonl").read_text()
    second = Run(out_dir, name, tiny_dir, *overrides)
    out = interrupt(second, signal.SIGTERM, lambda: STARTING in second.output())
    assert "SIGTERM before the next step: no step run; newest checkpoint: step 2" in out, out
    assert "resumed from" not in out and "step 3/4" not in out, out
    assert checkpoint_steps(run_dir) == [2]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before

    third = Run(out_dir, name, tiny_dir, *overrides)
    out = interrupt(third, signal.SIGINT, mid_step(3))
    assert "SIGINT: checkpoint of step 3 written" in out and "Traceback" not in out, out
    assert checkpoint_steps(run_dir) == [2, 3], out

    fourth = Run(out_dir, name, tiny_dir, *overrides)  # kill -9 of the group mid step 4
    fourth.wait_for(mid_step(4))
    fourth.signal_group(signal.SIGKILL)
    fourth.proc.wait(timeout=60)
    fourth.wait_for_exit_of_ray()  # the Ray node stops when its parent (the driver) dies
    fourth.cleanup()
    assert checkpoint_steps(run_dir) == [2, 3]

    last = Run(out_dir, name, tiny_dir, *overrides)
    assert last.wait() == 0, last.output()
    expected = {r["step"]: without_wall_clock(r) for r in read_metrics(reference_run)}
    got = {r["step"]: without_wall_clock(r) for r in read_metrics(run_dir)}
    assert sorted(got) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert got[step] == expected[step], step
