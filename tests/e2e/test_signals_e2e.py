"""e2e tier: stop signals to the whole process group of ``armor train``, as a shell, a terminal
(Ctrl-C) or a local launcher sends them, at three moments of one run, then its resume past
damaged checkpoints (``kill -9`` of the group: ``test_pipeline_e2e.py``):

1. SIGTERM to the group while step 2 runs (once its anchor file is written): the step
   finishes, its checkpoint is written, the exit message names the step on disk, exit 75.
   Ray's processes run in their own session and block the stop signals
   (``orchestration/actors/ray_node.py``), so the group signal reaches only the driver; they are gone
   once the driver has exited.
2. SIGTERM to the group during start-up of the resumed run: exit 75 before any step, nothing
   written (no new checkpoint, no temp directory, ``metrics.jsonl`` untouched).
3. SIGINT to the group while step 3 runs: the same as SIGTERM, no traceback.
4. Next to the checkpoints of steps 2 and 3, what kills leave: step 3's checkpoint without
   its metrics line (killed between the two), step 4's metrics line and anchor file without a
   checkpoint, a copy of step 3 as step 6 with ``orchestrator.pt`` cut short, a copy as step 5
   holding a crafted pickle (manifest re-signed) and the ``.tmp-*`` of a killed save. The last
   ``--resume auto`` says why it skips 6 and 5, resumes from step 3 without running the
   pickle, writes step 3's line back from its checkpoint, removes the temp dir and completes
   the run, logging step 4 once; while it runs, a second run on the directory is refused
   before Ray starts, and every port the run listens on (Ray, workers) is on loopback.
5. W&B logs offline throughout: every start continues the one W&B run whose id the run
   directory keeps (``RUN_DIR/wandb_run_id``).

Every step's metrics equal the uninterrupted reference run's (timings excepted). The run waits
on its own log lines and files, never on a clock.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics, without_wall_clock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crafted_checkpoint import plant_crafted_pickle  # noqa: E402
from e2e_runs import CACHED, Run  # noqa: E402
from process_group import is_loopback, listening_addresses, process_group_and_ray  # noqa: E402

pytestmark = pytest.mark.e2e

STARTING = "armor train: starting"
WANDB_OFFLINE = ("logging.wandb=true", "logging.wandb_mode=offline", "logging.wandb_group=e2e")
"""W&B on, offline (nothing leaves the host): a requeue continues the run's W&B run."""


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
def test_group_signals_and_damaged_checkpoints_then_exact_resume(reference_run, tiny_dir, out_dir):
    name = "signalled"
    run_dir = out_dir / name
    mid_step = lambda step: (run_dir / "anchors" / f"step_{step:06d}.jsonl").is_file  # noqa: E731
    overrides = (*CACHED, "run.ckpt_every=100", *WANDB_OFFLINE)  # checkpoints: signal and end

    first = Run(out_dir, name, tiny_dir, *overrides)
    out = interrupt(first, signal.SIGTERM, mid_step(2))  # after step 2's rollout
    assert "SIGTERM: checkpoint of step 2 written" in out, out
    assert checkpoint_steps(run_dir) == [2], out

    metrics_before = (run_dir / "metrics.jsonl").read_text()
    second = Run(out_dir, name, tiny_dir, *overrides)
    out = interrupt(second, signal.SIGTERM, lambda: STARTING in second.text())
    assert "SIGTERM before the next step: no step run; newest checkpoint: step 2" in out, out
    assert "resumed from" not in out and "step 3/4" not in out, out
    assert checkpoint_steps(run_dir) == [2]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before

    third = Run(out_dir, name, tiny_dir, *overrides)
    out = interrupt(third, signal.SIGINT, mid_step(3))
    assert "SIGINT: checkpoint of step 3 written" in out and "Traceback" not in out, out
    assert checkpoint_steps(run_dir) == [2, 3], out

    drop_metrics_line(run_dir, 3)  # killed after step 3's checkpoint, before its line
    plant_unfinished_step(run_dir, reference_run, 4)
    marker = plant_damaged_checkpoints(run_dir, out_dir / "pwned")
    last = Run(out_dir, name, tiny_dir, *overrides)
    ports = ports_and_second_writer_refused(last, lambda: Run(out_dir, name, tiny_dir, *overrides))
    assert last.wait() == 0, last.output()
    assert ports and all(is_loopback(a) for a in ports), ports
    text = Path(last.log.name).read_text()
    ckpts = run_dir / "checkpoints"
    assert "skipping" in text and "step_000006" in text and "orchestrator.pt has" in text, text
    assert "step_000005" in text and "safe loader" in text and not marker.exists(), text
    assert f"resumed from {ckpts / 'step_000003'}" in text, text
    assert "the line of step 3 written back from its checkpoint" in text, text
    assert not list(ckpts.glob(".tmp-*")) and (ckpts / "step_000006").is_dir()  # never deleted
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]  # step 4 once
    expected = {r["step"]: without_wall_clock(r) for r in read_metrics(reference_run)}
    got = {r["step"]: without_wall_clock(r) for r in read_metrics(run_dir)}
    for step in (1, 2, 3, 4):
        assert got[step] == expected[step], step
    assert_one_wandb_run(run_dir, starts=3)  # runs 1, 3 and the last log (2 may stop before)


def assert_one_wandb_run(run_dir: Path, starts: int) -> None:
    """Every start of the run directory logged to the W&B run whose id it keeps."""
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) >= starts, offline
    assert all((d / f"run-{run_id}.wandb").is_file() for d in offline), (run_id, offline)


def drop_metrics_line(run_dir: Path, step: int) -> None:
    """What a run killed after committing the checkpoint of ``step`` but before appending its
    metrics line leaves; the checkpoint carries the line and the resume writes it back."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if json.loads(line)["step"] != step))


def plant_unfinished_step(run_dir: Path, reference_run: Path, step: int) -> None:
    """What a run killed after logging ``step`` but before checkpointing it leaves: the step's
    metrics line and anchor file (copied from the reference run); a resume recomputes both."""
    lines = (reference_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.writelines(line for line in lines if json.loads(line)["step"] == step)
    for path in (reference_run / "anchors").glob(f"step_{step:06d}.jsonl*"):
        shutil.copy(path, run_dir / "anchors" / path.name)


def plant_damaged_checkpoints(run_dir: Path, marker: Path) -> Path:
    """Next to the run's newest checkpoint (step 3): a copy as step 6 with ``orchestrator.pt``
    truncated, a copy as step 5 whose ``orchestrator.pt`` is a pickle that would create
    ``marker`` (manifest re-signed, so only the safe loader stands in its way), and the temp
    dir of a killed save. Returns ``marker``."""
    ckpts = run_dir / "checkpoints"
    shutil.copytree(ckpts / "step_000003", ckpts / "step_000006")
    state = ckpts / "step_000006" / "orchestrator.pt"
    state.write_bytes(state.read_bytes()[:100])
    shutil.copytree(ckpts / "step_000003", ckpts / "step_000005")
    plant_crafted_pickle(ckpts / "step_000005", marker, 5)
    (ckpts / ".tmp-step_000004" / "trainer").mkdir(parents=True)
    return marker


def ports_and_second_writer_refused(run: Run, start_second) -> dict[str, int]:
    """Once ``run`` has resumed, stop its driver (it holds its run-dir lock and Ray), read the
    ports its processes listen on, and check that a second run on the same directory
    (``start_second()``) exits 2 before starting Ray; then let ``run`` go on."""
    log = Path(run.log.name)
    run.wait_for(lambda: "resumed from" in log.read_text())
    os.killpg(run.proc.pid, signal.SIGSTOP)  # `armor train` and the driver, its child
    try:
        ports = listening_addresses(process_group_and_ray(run.proc.pid, run.ray_tmp))
        second = start_second()
        assert second.proc.wait(timeout=120) == 2, second.output()
        assert "in use by another run" in second.text()
        assert not any(Path(second.ray_tmp).iterdir())  # refused before Ray started
        second.cleanup()
    finally:
        os.killpg(run.proc.pid, signal.SIGCONT)
    return ports
