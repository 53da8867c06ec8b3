"""e2e tier: faults in the middle of a run of the tiny config (``orchestration/actors/faults.py``,
``orchestration/actors/recovery.py``), each ending with every step's metrics equal to the
uninterrupted reference run's (timings excepted):

1. SIGSTOP of the rollout worker when step 1's metrics line is written (alive, never answering:
   step 2's rollout call passes its learned deadline, the worker is named and killed within
   a minute and the rollout drawn again), ``kill -9`` of its replacement when step 2's anchor
   file is written (while the trainer works: the weight push is sent again), and SIGSTOP of
   the reward worker when step 3's anchor file is written (stuck in step 4's rollout): each
   is replaced in the run, which ends normally with no stopped process left;
   ``recoveries.jsonl`` names the three with their reason.
2. SIGSTOP of the trainer rank when step 3's anchor file is written: past its deadline it is
   named and killed, and the run stops with exit 75 naming the newest complete checkpoint
   (step 2) and ``--resume auto``; no process of the run is left (Ray's, the actors', the
   checkpoint writer's helpers). The resumed run gets the same stop and a SIGTERM right
   after: exit 75 within the signal lead without the stuck call (``orchestration.stop_wait_s``
   lowered to 5 s), nothing left behind; the next resume completes the run.

The stuck runs lower ``orchestration.call_deadline_floor_s`` to 15 s (default 30 s) to keep
the tier short; everything else is the default.
3. The disk fills up during a save (another writer takes the free space of the run's file
   system, a 64 MiB tmpfs, once the save's temporary directory appears): exit 74, the error
   names the checkpoint's path and the bytes needed and free, the temporary directory is gone
   and step 2's checkpoint is intact; with the space freed, ``--resume auto`` runs on until
   the disk fills again between checkpoints (once step 3's anchor file is written): exit 74,
   the error names the file the run was writing and the intact checkpoint, nothing of the run
   is left; with the space freed again, ``--resume auto`` completes the run.

Every kill and fill waits on a file or a line the run writes, never on a clock.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics, without_wall_clock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_runs import CACHED, Run  # noqa: E402
from process_group import actor_pids, run_pids  # noqa: E402

pytestmark = pytest.mark.e2e
SHORT_FLOOR = "orchestration.call_deadline_floor_s=15"


def wait_until_no_process_left(ray_tmp: str, timeout: float, output) -> None:
    """Until no process of the run is left: none has ``RAY_TMPDIR=ray_tmp`` in its environment
    (every process a run starts inherits it, the ones megatron-core spawns too)."""
    deadline = time.monotonic() + timeout
    while left := run_pids(ray_tmp):
        assert time.monotonic() < deadline, f"{left} outlived the run:\n{output()}"
        time.sleep(0.2)


def anchor_file(run_dir: Path, step: int) -> Path:
    return run_dir / "anchors" / f"step_{step:06d}.jsonl"


def kill_actor(run: Run, cls: str, ready, sig: int = signal.SIGKILL) -> int:
    """``sig`` (``kill -9``; SIGSTOP: stuck) to the run's live ``cls`` actor once ``ready()``;
    returns its pid."""
    run.wait_for(lambda: ready() and len(actor_pids(run.ray_tmp, cls)) == 1)
    (pid,) = actor_pids(run.ray_tmp, cls)
    os.kill(pid, sig)
    return pid


def stuck_line(run: Run, pid: int) -> bool:
    """Whether the run log names ``pid`` as stuck and killed."""
    text = Path(run.log.name).read_text()
    return f"pid {pid} on " in text and "stuck call: " in text


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def assert_metrics_equal(run_dir: Path, reference_run: Path) -> None:
    expected = {r["step"]: without_wall_clock(r) for r in read_metrics(reference_run)}
    got = {r["step"]: without_wall_clock(r) for r in read_metrics(run_dir)}
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert got[step] == expected[step], step


@pytest.mark.timeout(1200)
def test_dead_rollout_and_reward_workers_are_replaced_in_the_run(reference_run, tiny_dir, out_dir):
    run = Run(out_dir, "workers_killed", tiny_dir, *CACHED, SHORT_FLOOR)
    first = kill_actor(run, "RolloutWorker", lambda: 1 in run.steps_logged(), signal.SIGSTOP)
    run.wait_for(lambda: stuck_line(run, first), timeout=60)  # noticed within a minute
    second = kill_actor(run, "RolloutWorker", anchor_file(run.run_dir, 2).is_file)
    scorer = kill_actor(run, "RewardWorker", anchor_file(run.run_dir, 3).is_file, signal.SIGSTOP)
    run.wait_for(lambda: stuck_line(run, scorer), timeout=60)
    assert run.wait() == 0, run.output()
    assert first != second and gone(first) and gone(scorer)
    lines = (run.run_dir / "recoveries.jsonl").read_text().splitlines()
    events = [(e["step"], e["phase"], e["actor"], e["reason"]) for e in map(json.loads, lines)]
    # the kill -9 lands after step 2's anchor file, in whatever the driver does then on a
    # loaded machine: the weight push, validation, or step 3's rollout
    assert len(events) == 3 and events[1][2:] == ("RolloutWorker 0", "died"), events
    assert events[1][:2] in ((2, "sync"), (2, "validation"), (3, "rollout")), events
    assert events[0] == (2, "rollout", "RolloutWorker 0", "stuck"), events
    assert events[2] == (4, "rollout", "RewardWorker 0", "stuck"), events
    text = Path(run.log.name).read_text()
    assert text.count("recovery: ") == 3 and "Traceback" not in text, text[-4000:]
    assert "call deadlines: 10 x p90" in text and "call deadline: generate 15s" in text
    assert_metrics_equal(run.run_dir, reference_run)
    rows = {r["step"]: r for r in read_metrics(run.run_dir)}
    assert rows[2]["faults/stuck_rollout"] == 1 and rows[4]["faults/stuck_reward"] == 1
    last = rows[4]  # the replacements' memory is measured, not the dead's
    assert last["mem/rollout0_gb"] > 0 and last["mem/reward0_gb"] > 0, last


@pytest.mark.timeout(1200)
def test_a_stuck_trainer_rank_stops_the_run_for_a_requeue_and_it_resumes(
    reference_run, tiny_dir, out_dir
):
    run = Run(out_dir, "trainer_killed", tiny_dir, *CACHED, SHORT_FLOOR)
    rank = kill_actor(run, "TrainerWorker", anchor_file(run.run_dir, 3).is_file, signal.SIGSTOP)
    assert run.proc.wait(timeout=90) == 75, run.output()
    # the actors and what they started (the checkpoint writer's helpers too)
    wait_until_no_process_left(run.ray_tmp, 60, run.output)
    run.wait_for_exit_of_ray(timeout=60)
    run.cleanup()
    text = Path(run.log.name).read_text()  # all of it: Ray's lines about the death follow
    newest = run.run_dir / "checkpoints" / "step_000002"
    said = [line for line in text.splitlines() if line.startswith("armor train:")]
    stuck = f"TrainerWorker 0 failed (StuckCallError: TrainerWorker 0 (pid {rank} on "
    assert any(stuck in x for x in said), "\n".join(said)
    assert f"Newest complete checkpoint: step 2 ({newest})" in text and "--resume auto" in text
    stopped_during_a_stuck_call(out_dir, tiny_dir, run.run_dir, newest)
    resumed = Run(out_dir, "trainer_killed", tiny_dir, *CACHED)
    assert resumed.wait() == 0, resumed.output()
    assert f"resumed from {newest} at step 2" in Path(resumed.log.name).read_text()
    assert_metrics_equal(run.run_dir, reference_run)


def stopped_during_a_stuck_call(out_dir: Path, tiny_dir: Path, run_dir: Path, newest: Path):
    """The resumed run: its trainer rank stopped and a SIGTERM sent once step 3's anchor file
    is written (the rest of step 3 needs the rank): exit 75 within the signal lead, without
    the stuck call, on the newest checkpoint; no process of the run left."""
    anchor_file(run_dir, 3).unlink()  # the first run's, of a step no checkpoint holds
    run = Run(out_dir, "trainer_killed", tiny_dir, *CACHED, SHORT_FLOOR,
              "orchestration.stop_wait_s=5")  # fmt: skip
    kill_actor(run, "TrainerWorker", anchor_file(run_dir, 3).is_file, signal.SIGSTOP)
    run.signal_group(signal.SIGTERM)
    signalled = time.monotonic()
    assert run.proc.wait(timeout=120) == 75, run.output()
    assert time.monotonic() - signalled < 60, "not within Slurm's signal lead"
    wait_until_no_process_left(run.ray_tmp, 60, run.output)
    run.cleanup()
    text = Path(run.log.name).read_text()
    assert "armor train: SIGTERM arrived and " in text, text[-3000:]
    assert "did not finish within orchestration.stop_wait_s=5s: exiting 75 without it" in text
    assert f"Newest complete checkpoint: step 2 ({newest})" in text


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (root only: mounting needs CAP_SYS_ADMIN)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Another writer takes every free byte of ``disk`` (in shrinking pieces, while the run
    writes too, until not a page is left)."""
    filler, size, piece = disk / "filler", 0, 1 << 24
    with filler.open("wb") as f:
        while piece >= 4096:
            try:
                os.posix_fallocate(f.fileno(), size, piece)
                size += piece
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                piece //= 2
    assert shutil.disk_usage(disk).free < 1 << 16
    return filler


@pytest.mark.timeout(1200)
def test_a_full_disk_during_a_save_is_named_and_the_previous_checkpoint_resumes(
    reference_run, tiny_dir, out_dir, small_disk
):
    on_disk = (*CACHED, f"run.output_dir={small_disk}")
    run = Run(out_dir, "disk_full", tiny_dir, *on_disk)
    run.run_dir = small_disk / "disk_full"
    saving = run.run_dir / "checkpoints" / ".tmp-step_000004"
    run.wait_for(saving.is_dir)  # the save of step 4 is under way: the free-space check passed
    filler = fill(small_disk)
    assert run.wait() == 74, run.output()
    text = Path(run.log.name).read_text()
    path = run.run_dir / "checkpoints" / "step_000004"
    assert f"DiskFullError: no space left while writing the checkpoint of step 4 to {path}" in text
    assert "MiB needed" in text and " free under " in text, text
    intact = run.run_dir / "checkpoints" / "step_000002"
    assert f"the previous checkpoint {intact} is intact" in text and "Traceback" not in text
    assert not saving.exists() and not path.exists()
    filler.unlink()
    full_between_checkpoints(out_dir, tiny_dir, on_disk, run.run_dir, small_disk, intact)
    resumed = Run(out_dir, "disk_full", tiny_dir, *on_disk)
    resumed.run_dir = run.run_dir
    assert resumed.wait() == 0, resumed.output()
    assert f"resumed from {intact} at step 2" in Path(resumed.log.name).read_text()
    assert_metrics_equal(run.run_dir, reference_run)


def full_between_checkpoints(out_dir, tiny_dir, on_disk, run_dir: Path, disk: Path, intact: Path):
    """The resume from step 2: the disk fills once step 3's anchor file is written, and a
    write of the run outside a save (an anchor file, ``metrics.jsonl``, TensorBoard) meets it
    before step 4's save: exit 74 naming the file and the intact checkpoint; nothing left."""
    for step in (3, 4):  # the first run's, of steps no checkpoint holds
        anchor_file(run_dir, step).unlink(missing_ok=True)
    started = time.monotonic()
    run = Run(out_dir, "disk_full", tiny_dir, *on_disk)
    run.run_dir = run_dir
    run.wait_for(anchor_file(run_dir, 3).is_file)
    filler = fill(disk)
    assert run.proc.wait(timeout=300) == 74, run.output()
    wait_until_no_process_left(run.ray_tmp, 60, run.output)
    run.cleanup()
    text = Path(run.log.name).read_text()
    assert f"DiskFullError: no space left on the device while writing {run_dir}/" in text, text
    assert f"the newest checkpoint {intact} is intact" in text and "Traceback" not in text
    assert not (run_dir / "checkpoints" / "step_000004").exists()
    filler.unlink()
    print(f"full between checkpoints: the run took {time.monotonic() - started:.1f}s")
