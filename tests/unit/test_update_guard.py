"""The driver's side of the non-finite guard (``orchestration/step/update_guard.py``): skipped
updates counted per step and in a row across steps, the error that stops a diverged run, and
the exit code it gets. Tier: unit."""

from __future__ import annotations

import math

import pytest

from megatron_armor.config import load_config
from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE
from megatron_armor.orchestration.step.step_metrics import reduce_update_metrics
from megatron_armor.orchestration.step.update_guard import (
    EXIT_DIVERGED,
    DivergedError,
    diverged_error,
    divergence_note,
    non_finite_terms,
    skip_metrics,
)

pytestmark = pytest.mark.unit

NAN = math.nan
APPLIED = {"train/skipped": 0.0, "loss/pg": 0.1, "loss/grad_norm": 0.5}
SKIPPED = {"train/skipped": 1.0, "loss/pg": NAN, "loss/objective": NAN, "loss/grad_norm": NAN}


def test_skipped_updates_are_counted_per_step_and_in_a_row():
    m, in_a_row = skip_metrics([APPLIED, SKIPPED], 0)
    assert m == {"train/skipped_updates": 1.0, "train/skipped_in_a_row": 1.0} and in_a_row == 1
    m, in_a_row = skip_metrics([SKIPPED, SKIPPED], in_a_row)  # the row goes on across steps
    assert m["train/skipped_in_a_row"] == 3.0 and in_a_row == 3
    m, in_a_row = skip_metrics([SKIPPED, APPLIED], in_a_row)  # an applied update ends it
    assert m == {"train/skipped_updates": 1.0, "train/skipped_in_a_row": 0.0} and in_a_row == 0


def test_a_step_mean_over_a_skipped_update_is_nan_and_its_flag_is_counted_not_averaged():
    out = reduce_update_metrics([APPLIED, SKIPPED])
    assert math.isnan(out["loss/pg"]) and "train/skipped" not in out
    assert out["train/updates"] == 2.0


def test_the_divergence_error_names_the_terms_the_step_and_the_settings():
    config = load_config(None, ["trainer.lr=1000", "trainer.max_skipped_updates=4"])
    metrics = reduce_update_metrics([SKIPPED, SKIPPED])
    err = diverged_error(config, 7, metrics, "/runs/x/checkpoints/step_000007")
    assert isinstance(err, DivergedError)
    msg = str(err)
    assert msg.startswith("training diverged: 4 optimizer updates in a row")
    assert "at step 7 (loss/grad_norm=nan, loss/objective=nan, loss/pg=nan)" in msg
    assert "trainer.lr=1000.0" in msg and "algo.rollout_correction.mode=none" in msg
    assert "step_000007" in msg and f"Exit {EXIT_DIVERGED}, not requeued" in msg
    assert non_finite_terms(APPLIED) == []


def test_the_diverged_exit_code_is_not_the_requeue_code():
    assert EXIT_DIVERGED not in (0, 1, 2, EXIT_REQUEUE) and EXIT_DIVERGED < 128


def test_the_acceptance_note_only_follows_a_troubled_step():
    assert divergence_note({"train/skipped_updates": 0.0, "loss/pg": 0.2}, 4) == ""
    note = divergence_note({"loss/ratio_max": math.inf, "train/skipped_updates": 0.0}, 4)
    assert note.startswith("the step before (step 4) logged non-finite loss/ratio_max")
