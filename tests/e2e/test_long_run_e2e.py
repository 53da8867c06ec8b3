"""e2e tier: what a long run meets early on a small scale — short batches, retired prompts, a
step below the floor — through ``armor train`` of the tiny config.

1. Short batches and retirement resume exactly after ``kill -9``: one generation batch of 16
   queries per step for ``B = 8`` (``algo.max_gen_batches=1``), so many steps accept fewer
   than 8 and train on what they have (``algo.min_batch_fraction=0.125``: one query), with
   ``G = 3`` (two on-policy samples: all-correct is common), ``algo.weak_filter`` and
   ``algo.ref_n=4`` (all-wrong groups the reference solved are kept: no step accepts none)
   and ``data.retire_solved_after=1``. An
   uninterrupted run of 8 steps, checkpointed every step, shows the first step ``S`` by which
   both a short batch and a retirement happened; a second run is killed (``kill -9`` of its
   process group) once step ``S + 1``'s anchor file is written, resumed from its newest
   checkpoint (no process of the killed run left: Ray's, the actors', the checkpoint
   writer's), and must log exactly the uninterrupted run's metrics (timings and machine
   state excepted) at every step: the retired set, the streaks and the acceptance watcher's
   series come back from the checkpoint.
2. A step below the floor exits 3, naming the settings, with ``train_partial`` and a floor of
   the whole batch, and with ``algo.on_short_batch=error`` (the failure of runs before the
   setting existed).

Every wait is on a file or the process's exit, never a clock.
"""

from __future__ import annotations

import os
import sys

import pytest

from megatron_armor.observability.metrics import read_metrics, without_wall_clock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_runs import Run  # noqa: E402

pytestmark = pytest.mark.e2e

SHORT = ("rollout.batch=8", "rollout.gen_batch=8", "algo.max_gen_batches=1",
         "trainer.ppo_mini_batch=8")  # fmt: skip
RETIRING = (*SHORT, "rollout.gen_batch=16", "run.steps=8", "run.ckpt_every=1",
            "algo.group_size=3", "algo.ref_n=4", "algo.weak_filter=true",
            "algo.min_batch_fraction=0.125", "data.retire_solved_after=1")  # fmt: skip


def first_step_with_both(records: list[dict]) -> int | None:
    """The first step by which a short batch and a retirement have happened."""
    for r in records:
        if r["step"] and r.get("watch/short_batches") and r.get("data/retired"):
            return r["step"]
    return None


@pytest.mark.timeout(1500)
def test_short_batches_and_retirement_resume_exactly_after_kill_9(tiny_dir, out_dir):
    whole = Run(out_dir, "retiring", tiny_dir, *RETIRING)
    assert whole.wait() == 0, whole.output()
    expected = {r["step"]: without_wall_clock(r) for r in read_metrics(whole.run_dir)}
    step = first_step_with_both(list(expected.values()))
    assert step is not None and step <= 6, [(s, r.get("watch/short_batches"),
                                             r.get("data/retired")) for s, r in expected.items()]  # fmt: skip
    assert any(r.get("data/retired_step") for r in expected.values() if r["step"] > step)
    assert sum(r["anchor/short_batch"] for r in expected.values() if r["step"]) >= 2

    run_dir = out_dir / "killed"
    killed = Run(out_dir, "killed", tiny_dir, *RETIRING)
    killed.wait_for((run_dir / "anchors" / f"step_{step + 1:06d}.jsonl").is_file)
    killed.kill_group(nothing_left=True)  # the checkpoint writer's processes too
    resumed = Run(out_dir, "killed", tiny_dir, *RETIRING)
    assert resumed.wait() == 0, resumed.output()
    text = resumed.output()
    resumed_at = int(text.split("resumed from ")[1].split("step_")[1][:6])
    assert resumed_at >= step, text
    got = {r["step"]: without_wall_clock(r) for r in read_metrics(run_dir)}
    assert sorted(got) == sorted(expected)
    for s in sorted(expected):
        assert got[s] == expected[s], s


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("policy", "fix"),
    [
        ("algo.min_batch_fraction=1.0", "lower algo.min_batch_fraction (now 1.0: a short batch"),
        ("algo.on_short_batch=error", "set algo.on_short_batch=train_partial"),
    ],
)
def test_a_step_below_the_floor_exits_3_naming_the_settings(tiny_dir, out_dir, policy, fix):
    name = policy.split("=")[0].split(".")[1]
    run = Run(out_dir, f"floor-{name}", tiny_dir, *SHORT, policy)
    code = run.wait()
    text = run.output()
    assert code == 3, text
    assert "AcceptanceError: only" in text and "of the 8 queries a step needs" in text, text
    assert fix in text and "raise algo.max_gen_batches (now 1)" in text, text
    assert "exiting 3 (not 75" in text and "resume with --resume auto" in text, text
    assert "Traceback" not in text, text


@pytest.mark.timeout(900)
def test_without_a_floor_a_step_that_accepts_nothing_makes_no_update(tiny_dir, out_dir):
    """``algo.group_size=2``: ARMOR's one on-policy sample is all-correct or all-wrong, so rule
    (a) accepts nothing, ever; with ``algo.min_batch_fraction=0`` every step is empty and the
    run still ends normally (checkpoints, validation, resets)."""
    run = Run(out_dir, "nothing-accepted", tiny_dir, "algo.group_size=2",
              "algo.min_batch_fraction=0")  # fmt: skip
    assert run.wait() == 0, run.output()
    steps = [r for r in read_metrics(run.run_dir) if r["step"]]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert (r["anchor/accepted"], r["anchor/kept"], r["anchor/short_batch"]) == (0, 0, 1)
        assert r["train/updates"] == 0 and not any(k.startswith("loss/") for k in r), r
    assert [r["reset/performed"] for r in steps] == [0, 1, 0, 1]
    assert sorted(p.name for p in (run.run_dir / "checkpoints").glob("step_*")) == [
        "step_000002", "step_000004"]  # fmt: skip
