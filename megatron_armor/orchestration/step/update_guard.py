"""The driver's side of the non-finite guard (docs/trainer.md, non-finite guard).

The trainer ranks skip an update whose loss or gradient norm is not finite on some rank
(``trainer/optim.py: guarded_step``; the update's metrics say ``train/skipped``). Here the
driver counts the skipped updates of each step (``train/skipped_updates``) and those in a
row across steps (``train/skipped_in_a_row``, kept in the checkpoint's
:class:`~megatron_armor.orchestration.run.run_state.RunState`), and after
``trainer.max_skipped_updates`` in a row it stops the run: the loop checkpoints the step
(its weights are those of the last applied update) and raises :class:`DivergedError`, which
``armor train`` turns into exit code :data:`EXIT_DIVERGED`. Slurm requeues only exit 75, so a
run that diverged is not started again with the settings that made it diverge.
"""

from __future__ import annotations

import math

from megatron_armor.config.validate import get_key

EXIT_DIVERGED = 65
"""``armor train`` / ``armor pipeline`` exit code after :class:`DivergedError` (``EX_DATAERR``;
not the requeue code 75): resubmit with changed settings, from the checkpoint it wrote."""

SETTINGS_TO_CHECK = (
    "trainer.lr",
    "trainer.grad_clip",
    "trainer.precision",
    "trainer.adam_eps",
    "algo.log_ratio_clamp",
    "algo.kl_coef",
    "algo.rollout_correction.mode",
)
"""The settings a divergence message names, with their values."""


class DivergedError(RuntimeError):
    """``trainer.max_skipped_updates`` updates in a row had a non-finite loss or gradient
    norm; the message names the terms, the step and the settings to look at."""


def non_finite_terms(update: dict[str, float]) -> list[str]:
    """The ``loss/*`` terms and the gradient norm of one update's metrics that are not
    finite, e.g. ``["loss/objective", "loss/pg", "loss/grad_norm"]``."""
    return [k for k, v in sorted(update.items()) if k.startswith("loss/") and not math.isfinite(v)]


def skip_metrics(updates: list[dict[str, float]], in_a_row: int) -> tuple[dict[str, float], int]:
    """``train/skipped_updates`` (updates of this step skipped) and ``train/skipped_in_a_row``
    (counting on from ``in_a_row``, the count after the step before; an applied update sets
    it back to 0), and that count."""
    skipped = 0
    for update in updates:
        if update.get("train/skipped", 0.0) >= 1.0:
            skipped, in_a_row = skipped + 1, in_a_row + 1
        else:
            in_a_row = 0
    return {"train/skipped_updates": float(skipped), "train/skipped_in_a_row": float(in_a_row)}, (
        in_a_row
    )


def diverged_error(config, step: int, metrics: dict[str, float], checkpoint: str) -> DivergedError:
    """:class:`DivergedError` at ``step``: the non-finite terms of its metrics (``metrics``,
    the step's means over its updates), the checkpoint written, the settings to look at and
    the exit code."""
    limit = config.trainer.max_skipped_updates
    terms = ", ".join(f"{k}={metrics[k]}" for k in non_finite_terms(metrics)) or "no loss term"
    values = ", ".join(f"{key}={get_key(config, key)}" for key in SETTINGS_TO_CHECK)
    return DivergedError(
        f"training diverged: {limit} optimizer updates in a row (trainer.max_skipped_updates) "
        f"had a non-finite loss or gradient norm, the last at step {step} ({terms}); none of "
        f"them was applied. The checkpoint of step {step} ({checkpoint}) holds the weights of "
        f"the last applied update. Settings to look at: {values}. Exit {EXIT_DIVERGED}, not "
        "requeued (a requeue would repeat it): change them and resume with --resume auto"
    )


def divergence_note(previous: dict, step: int, all_wrong: bool = False) -> str:
    """The start of an acceptance error right after ``step`` (``previous``: its metrics), when
    that step skipped updates, logged non-finite values, or was followed by nothing but wrong
    answers (``all_wrong``: every query of this step rejected as all-wrong) although its own
    on-policy samples were partly right — an update that diverged (e.g. ``trainer.lr`` far too
    large: finite, but the policy is gone). It names that before the acceptance settings,
    since a diverged policy is the likelier cause; ``""`` after a normal step."""
    skipped = previous.get("train/skipped_updates") or 0.0
    bad = [k for k, v in sorted(previous.items()) if isinstance(v, float) and not math.isfinite(v)]
    acc = previous.get("reward/policy_acc") or 0.0
    what = []
    if skipped:
        what.append(f"skipped {int(skipped)} of {int(previous.get('train/updates', skipped))} "
                    "optimizer updates for a non-finite loss or gradient norm")  # fmt: skip
    if bad:
        what.append(f"logged non-finite {', '.join(bad[:6])}")
    if all_wrong and acc > 0:
        norm = previous.get("loss/grad_norm", math.nan)
        what.append(f"had on-policy accuracy {acc:.3f}, and after its updates (lr "
                    f"{previous.get('lr', math.nan):.3g}, loss/grad_norm {norm:.3g}) every query "
                    "drawn now has only wrong answers")  # fmt: skip
    if not what:
        return ""
    return (
        f"the step before (step {step}) {' and '.join(what)}: the policy has likely diverged, "
        "which leaves too few queries with both right and wrong answers; look at that first "
        f"(settings: {', '.join(SETTINGS_TO_CHECK)}). Otherwise: "
    )
