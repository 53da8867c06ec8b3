"""e2e tier: ``orchestration.async_rollout=bounded`` (partial rollouts, staleness up to 4) on the
tiny config, end to end, and after a ``kill -9`` with partial rollouts in flight.

The runs' 4 steps reset every 3 steps and checkpoint every 2; responses decode at most 10
tokens per round of a window (``max_new_tokens`` 40 over ``max_staleness`` 4), so the answers
of the tiny task (18-26 tokens) that a window ends with are carried to the next one and
continued under the weights pushed since. Step 1's window is drawn on the weights it trains
from; steps 2 and 3 train windows drawn beside the step before; step 3 resets (step 4's window
comes after it, continuing what step 3's window carried) and step 4 is the last.

1. The uninterrupted run: responses were carried and continued, every trained token is at most
   4 versions old and some are 2, a stale token's engine log-prob is not the trainer's (the
   decoupled weight corrects it) while the anchors' log-probs are the trainer's reference's
   (the reference does not change between resets), and step 2's checkpoint holds the
   responses in flight with each token's version.
2. ``kill -9`` of the run's process group once step 2's checkpoint is committed; ``--resume
   auto`` gives every step's metrics of the uninterrupted run.
3. Resuming that checkpoint with ``async_rollout=off`` is refused before anything starts.

The runs wait on their own files, never on a clock.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics, without_wall_clock
from megatron_armor.orchestration.run.run_state import RunState
from megatron_armor.orchestration.step.partial_rollout import PartialRollouts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_runs import Run  # noqa: E402

pytestmark = pytest.mark.e2e

BOUNDED = ("orchestration.async_rollout=bounded", "orchestration.max_staleness=4",
           "algo.rollout_correction.mode=token_tis", "algo.reset.every=3")  # fmt: skip


def metrics_of(run_dir: Path) -> list[dict]:
    return [without_wall_clock(r) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def bounded_run(tiny_dir, out_dir) -> Path:
    run = Run(out_dir, "bounded", tiny_dir, *BOUNDED)
    code = run.wait()
    assert code == 0, run.output()
    return run.run_dir


def test_partial_rollouts_carry_over_within_the_bound_and_anchors_stay_exact(bounded_run):
    lines = {r["step"]: r for r in read_metrics(bounded_run)}
    steps = [lines[t] for t in (1, 2, 3, 4)]
    assert [r["async/drained"] for r in steps] == [0.0, 0.0, 1.0, 1.0]
    assert [r["reset/performed"] for r in steps] == [0.0, 0.0, 1.0, 0.0]
    assert "async/dropped_at_reset" in lines[3]
    assert max(r["async/partial_carried"] for r in steps) > 0
    assert max(r["async/continued_tokens"] for r in steps) > 0
    assert all(r["staleness/age_max"] <= 4 for r in steps)
    assert max(r["staleness/age_max"] for r in steps) >= 2
    assert steps[0]["staleness/age_max"] == 0  # drawn on the weights it trains from
    assert steps[0]["rollout/policy_logprob_absdiff_max"] <= 1e-3
    stale = [r for r in steps if r["staleness/age_mean"] > 0]
    assert stale and all(r["rollout/policy_logprob_absdiff_max"] > 1e-2 for r in stale)
    for r in steps:
        assert r["rollout/anchor_logprob_absdiff_max"] <= 1e-3, r["step"]
        assert r["correction/policy_weight_mean"] > 0
    held = PartialRollouts.from_state(
        RunState.load(bounded_run / "checkpoints" / "step_000002").pending
    )
    carried = [s for q in held.in_flight for s in q.samples if s.finish_reason == "partial"]
    assert carried and all(len(s.token_versions()) == s.response_len > 0 for s in carried)


@pytest.mark.timeout(900)
def test_kill_9_with_partial_rollouts_in_flight_then_resume_exactly(bounded_run, tiny_dir, out_dir):
    first = Run(out_dir, "bounded_killed", tiny_dir, *BOUNDED)
    meta = first.run_dir / "checkpoints" / "step_000002" / "meta.json"
    first.wait_for(meta.is_file)
    first.kill_group()
    held = RunState.load(meta.parent).pending
    assert PartialRollouts.from_state(held).in_flight, "nothing in flight at step 2"
    second = Run(out_dir, "bounded_killed", tiny_dir, *BOUNDED)
    code = second.wait()
    assert code == 0, second.output()
    assert "resumed from" in second.text()
    assert metrics_of(second.run_dir) == metrics_of(bounded_run)


def test_partial_rollouts_resume_only_with_bounded(bounded_run, tiny_dir, out_dir):
    shutil.copytree(bounded_run, out_dir / "bounded_off",
                    ignore=shutil.ignore_patterns("step_000004"))  # fmt: skip
    run = Run(out_dir, "bounded_off", tiny_dir, "algo.reset.every=3")
    code = run.wait()
    out = run.output()
    assert code == 2, out
    assert "holds partial rollouts in flight" in out and "async_rollout=bounded" in out
    assert "armor train: starting" not in out
