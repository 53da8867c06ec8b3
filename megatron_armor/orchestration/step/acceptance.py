"""When a step's generation batches do not accept ``rollout.batch`` queries (docs/algorithm.md,
anchor rollout: short batches).

After ``algo.max_gen_batches`` batches a step has ``k`` accepted groups. ``k >= B`` is the
normal case. Below ``B`` the step is *short*: with ``algo.on_short_batch: train_partial`` it
trains on the ``k`` groups when ``k`` reaches the floor (``config.validate.short_batch_floor``:
``ceil(algo.min_batch_fraction * B)``; a floor of 0 trains on any ``k``, and a step with
``k = 0`` makes no update); otherwise, and always with ``error``, it fails with
:class:`AcceptanceError`. The driver turns that error into exit
code :data:`EXIT_ACCEPTANCE`, never 75: a requeue would draw the same queries with the same
seeds and meet the same wall, so the message names the settings to change instead.
"""

from __future__ import annotations

import logging

from megatron_armor.algo.anchors import AcceptanceStats
from megatron_armor.algo.registry import get_anchor_mode, get_short_batch_policy
from megatron_armor.orchestration.step.update_guard import divergence_note

log = logging.getLogger(__name__)

EXIT_ACCEPTANCE = 3
"""``armor train`` / ``armor pipeline`` exit code of a step that could not accept enough
queries: change a setting the message names, then resume (``--resume auto``)."""


class AcceptanceError(RuntimeError):
    """Not enough queries accepted within ``algo.max_gen_batches`` generation batches."""


def setting_hints(stats: AcceptanceStats, floor: int, config) -> list[str]:
    """The settings that would let such a step through, each with its current value."""
    algo, rollout = config.algo, config.rollout
    hints = [f"raise algo.max_gen_batches (now {algo.max_gen_batches})",
             f"raise rollout.gen_batch (now {rollout.gen_batch})",
             f"lower rollout.batch (now {rollout.batch})"]  # fmt: skip
    if get_short_batch_policy(algo.on_short_batch).trains_partial:
        hints.append(f"lower algo.min_batch_fraction (now {algo.min_batch_fraction}: a short "
                     f"batch needs {floor} queries)")  # fmt: skip
    else:
        hints.append("set algo.on_short_batch=train_partial to train on the accepted groups "
                     f"(at least algo.min_batch_fraction={algo.min_batch_fraction} of the batch)")  # fmt: skip
    mode = get_anchor_mode(algo.anchor)
    if stats.rejected_no_ref_correct and mode.draws_reference:
        hints.append(f"raise algo.ref_n (now {algo.ref_n}) for more reference attempts")
    if stats.rejected_all_wrong and not algo.weak_filter and mode.needs_reference_correct:
        hints.append("set algo.weak_filter=true to keep all-wrong groups the reference solved")
    if 2 * stats.rejected_all_correct > stats.queries_seen - stats.accepted:
        hints.append(solved_hint(config.data.retire_solved_after))
    return hints


def solved_hint(retire_after: int) -> str:
    """The hint when most rejections were all-correct groups (the policy solves them)."""
    if retire_after > 0:
        return (f"most rejected queries were all-correct although data.retire_solved_after="
                f"{retire_after} retires solved ones: lower it, or train on harder data")  # fmt: skip
    return ("most rejected queries were all-correct (the policy solves them): train on harder "
            "data, set data.retire_solved_after (e.g. 3) to take solved queries out of the "
            "sampler, or algo.min_batch_fraction=0 to go on with what the steps accept")  # fmt: skip


def acceptance_error(stats: AcceptanceStats, need: int, floor: int, config,
                     previous: dict | None = None, step: int = 0) -> AcceptanceError:  # fmt: skip
    """The error of a step ``step`` that accepted fewer than ``floor`` queries (``need`` =
    ``B``): the rates seen and which settings to change; after a step that skipped updates,
    logged non-finite values or whose updates left only wrong answers (``previous``, its
    metrics), that first (``update_guard.divergence_note``)."""
    m = stats.as_metrics()
    short = f"; a short batch needs {floor} (algo.min_batch_fraction)" if floor < need else ""
    all_wrong = stats.queries_seen > 0 and stats.rejected_all_wrong == stats.queries_seen
    return AcceptanceError(
        divergence_note(previous or {}, step - 1, all_wrong)
        + f"only {stats.accepted} of the {need} queries a step needs (rollout.batch) were accepted "
        f"after {stats.gen_batches} generation batches (algo.max_gen_batches){short}: acceptance "
        f"rate {m['anchor/acceptance_rate']:.3f} over {stats.queries_seen} queries; rejected "
        f"{stats.rejected_all_correct} all-correct, {stats.rejected_all_wrong} all-wrong, "
        f"{stats.rejected_no_ref_correct} without a correct reference (reference accuracy "
        f"{m['anchor/ref_acc']:.3f}). To fix: " + "; ".join(setting_hints(stats, floor, config))
    )


def check_short(step: int, stats: AcceptanceStats, kept: int, floor: int, config,
                warn: bool, previous: dict | None = None) -> None:  # fmt: skip
    """A step whose ``algo.max_gen_batches`` batches accepted ``kept < B`` queries: the
    :class:`AcceptanceError` below ``floor`` (``previous``: the step before's metrics);
    else, with ``warn`` (the run's first short batch), the console warning of
    :func:`short_batch_warning`."""
    need = config.rollout.batch
    if kept < floor:
        raise acceptance_error(stats, need, floor, config, previous, step)
    if warn:
        log.warning(short_batch_warning(step, stats, kept, need, floor))


def short_batch_warning(step: int, stats: AcceptanceStats, kept: int, need: int, floor: int) -> str:
    """The console line of a run's first short batch (later ones show ``SHORT batch of k`` in their
    step line and ``anchor/short_batch`` in the metrics)."""
    rate = stats.as_metrics()["anchor/acceptance_rate"]
    return (f"step {step}: short batch: {kept} of the {need} queries a step needs (rollout.batch) "
            f"accepted after {stats.gen_batches} generation batches (acceptance rate {rate:.3f}); "
            f"training on them (algo.on_short_batch=train_partial, floor {floor}); later short "
            "steps are marked in the step line and by anchor/short_batch")  # fmt: skip


def exit_message(err: Exception, newest: tuple[int, object] | None) -> str:
    """What the driver prints before it exits :data:`EXIT_ACCEPTANCE`; ``newest`` is the
    newest complete checkpoint ``(step, path)`` or ``None``."""
    where = f"step {newest[0]} ({newest[1]})" if newest else "none (a new start begins at step 0)"
    return (f"{type(err).__name__}: {err}\nexiting {EXIT_ACCEPTANCE} (not 75: a requeue would meet "
            f"the same queries again); newest checkpoint: {where}; change a setting above and "
            "resume with --resume auto")  # fmt: skip
