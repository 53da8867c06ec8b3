"""Anchor acceptance and group assembly (docs/algorithm.md, anchor rollout, Algorithm 1 lines 3-19).

For each query the rollout produces ``policy_samples`` (``n_on`` on-policy responses) and,
for ``armor`` / ``filter_only``, ``reference_samples`` (``ref_n`` responses of ``pi_ref``) in
generation order, all scored (``acc``). A query is accepted iff

(a) ``1 <= #correct(policy) <= n_on - 1`` (some reward variance), and
(b) at least one reference response is correct (``armor``, ``filter_only`` only).

``weak_filter`` drops the lower bound of (a): an all-wrong on-policy set is kept when the
reference solved the query. Rejections are reported in this order: ``all_correct``,
``all_wrong`` (only when the lower bound applies), ``no_reference_correct``.

Group composition per mode (an :class:`AnchorMode` each, mapped by name in ``registry.py``):

- ``none``        rule (a); group = the ``G`` policy samples; no anchor (plain DAPO).
- ``armor``       rules (a)+(b); group = ``n_on = G - 1`` policy samples + the *first correct
                  reference response in generation order* at ``anchor_index = n_on``.
- ``filter_only`` rules (a)+(b); group = the policy samples; no anchor (referee control).
                  ``filter_policy_samples``: ``G`` (DAPO's group size; rule (a) over ``G``
                  samples) or ``G-1`` (ARMOR's ``n_on``: rule (a) over exactly the samples ARMOR
                  draws, and the same generation compute). The reference samples decide rule
                  (b) only and are never part of the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_armor.types import Group, Sample

REASONS = ("accepted", "all_correct", "all_wrong", "no_reference_correct")


FILTER_POLICY_SAMPLES: dict[str, int] = {"G": 0, "G-1": 1}
"""``algo.filter_policy_samples``: how many fewer than ``G`` policy samples ``filter_only`` draws."""


@dataclass(frozen=True)
class AnchorMode:
    """One ``algo.anchor`` mode: whether rule (b) applies, whether an anchor is inserted, and
    whether it is the filter-only control.

    ``is_filter_control``: Algorithm 1's acceptance without the anchor and without the mixed
    ratio (docs/algorithm.md, anchor rollout); ``algo.filter_policy_samples`` sizes its
    on-policy set, and a ratio that mixes in ``pi_ref`` is refused with it.
    """

    name: str
    needs_reference_correct: bool
    inserts_anchor: bool
    is_filter_control: bool = False

    @property
    def draws_reference(self) -> bool:
        """Whether the mode samples the reference (and so needs reference weights served)."""
        return self.needs_reference_correct or self.inserts_anchor

    def policy_samples(self, group_size: int, filter_policy_samples: str = "G") -> int:
        """``n_on``: ``G - 1`` when an anchor takes a slot of the group; ``G`` minus
        :data:`FILTER_POLICY_SAMPLES` for the filter control; else ``G``."""
        if filter_policy_samples not in FILTER_POLICY_SAMPLES:
            raise ValueError(
                f"algo.filter_policy_samples={filter_policy_samples!r}: "
                f"use one of {sorted(FILTER_POLICY_SAMPLES)}"
            )
        if self.inserts_anchor:
            return group_size - 1
        if self.is_filter_control:
            return group_size - FILTER_POLICY_SAMPLES[filter_policy_samples]
        return group_size


NONE = AnchorMode("none", needs_reference_correct=False, inserts_anchor=False)
ARMOR = AnchorMode("armor", needs_reference_correct=True, inserts_anchor=True)
FILTER_ONLY = AnchorMode(
    "filter_only",
    needs_reference_correct=True,
    inserts_anchor=False,
    is_filter_control=True,
)


@dataclass(frozen=True)
class AnchorSource:
    """One ``algo.anchor_source``: whether a query's reference samples are drawn once per
    reference period and reused (the anchor cache) instead of fresh each step."""

    name: str
    reuses_anchors: bool


GENERATE = AnchorSource("generate", reuses_anchors=False)
CACHE = AnchorSource("cache", reuses_anchors=True)


@dataclass(frozen=True)
class ShortBatchPolicy:
    """One ``algo.on_short_batch``: what a step does when its ``algo.max_gen_batches``
    generation batches accepted ``k < B`` queries (``B = rollout.batch``).

    ``trains_partial``: the step trains on the ``k`` accepted groups when ``k`` reaches
    :meth:`floor`, with the same ``B / ppo_mini_batch`` updates (each on ``k / updates``
    groups, the groups in turn when there are fewer than updates) and the loss's global
    normalizer (the tokens of the groups trained on, summed over micro-batches and
    data-parallel ranks): a short batch's update has a full batch's scale, from fewer
    samples; with a floor of 0 a step that accepted nothing makes no update. Without it (and
    below the floor) the step fails, naming the settings that would help."""

    name: str
    trains_partial: bool

    def floor(self, batch: int, min_fraction: float) -> int:
        """The fewest accepted groups a step trains on: ``B`` without ``trains_partial``, else
        ``ceil(min_fraction * B)`` (of the decimal value: ``0.3 * 10`` is 3; 0 with
        ``min_fraction`` 0)."""
        if not self.trains_partial:
            return batch
        return min(batch, math.ceil(round(min_fraction * batch, 9)))


STOP_ON_SHORT = ShortBatchPolicy("error", trains_partial=False)
TRAIN_PARTIAL = ShortBatchPolicy("train_partial", trains_partial=True)


def first_correct(samples: list[Sample]) -> Sample | None:
    """The first sample with ``acc`` in generation order, or ``None``."""
    return next((s for s in samples if s.acc), None)


def acceptance_reason(
    policy_samples: list[Sample],
    reference_samples: list[Sample],
    mode: AnchorMode,
    weak_filter: bool,
) -> str:
    """One of :data:`REASONS` for a query under rules (a)/(b) of docs/algorithm.md, anchor rollout."""
    n_correct = sum(bool(s.acc) for s in policy_samples)
    if n_correct == len(policy_samples):
        return "all_correct"
    lower_bound_applies = not (weak_filter and mode.needs_reference_correct)
    if n_correct == 0 and lower_bound_applies:
        return "all_wrong"
    if mode.needs_reference_correct and first_correct(reference_samples) is None:
        return "no_reference_correct"
    return "accepted"


def select_group(
    query_id: str,
    policy_samples: list[Sample],
    reference_samples: list[Sample],
    mode: str,
    weak_filter: bool,
) -> tuple[Group | None, str]:
    """Accept or reject one query; returns ``(group or None, reason)`` (docs/algorithm.md, anchor rollout).

    ``reference_samples`` must be in generation order (the anchor is the first correct one);
    all other reference samples are discarded.
    """
    from megatron_armor.algo.registry import get_anchor_mode  # registry imports this module

    anchor_mode = get_anchor_mode(mode)
    if not policy_samples:
        raise ValueError(f"query {query_id!r}: no policy samples to select a group from")
    reason = acceptance_reason(policy_samples, reference_samples, anchor_mode, weak_filter)
    if reason != "accepted":
        return None, reason
    samples = list(policy_samples)
    anchor_index = None
    if anchor_mode.inserts_anchor:
        anchor_index = len(samples)
        samples.append(first_correct(reference_samples))
    return Group(query_id=query_id, samples=samples, anchor_index=anchor_index), reason


@dataclass
class AcceptanceStats:
    """Per-step acceptance statistics (docs/algorithm.md, anchor rollout; the reference code logged none).

    ``ref_acc`` is the accuracy of all reference responses drawn this step;
    ``anchor_len_mean`` the mean response length of inserted anchors;
    ``rejected_cached_no_ref_correct`` the part of ``rejected_no_ref_correct`` decided by the
    anchor cache's remembered verdict before any on-policy sample of the query was drawn.
    """

    gen_batches: int = 0
    queries_seen: int = 0
    accepted: int = 0
    rejected_all_correct: int = 0
    rejected_all_wrong: int = 0
    rejected_no_ref_correct: int = 0
    rejected_cached_no_ref_correct: int = 0
    ref_samples: int = 0
    ref_correct: int = 0
    anchors: int = 0
    anchor_len_sum: int = 0
    accepted_ids: list[str] = field(default_factory=list)

    def add_generation_batch(self) -> None:
        """Count one generation batch (``gen_batch`` queries) tried this step."""
        self.gen_batches += 1

    def record(
        self,
        reason: str,
        reference_samples: list[Sample],
        anchor: Sample | None,
        query_id: str | None = None,
        cached_verdict: bool = False,
    ) -> None:
        """Count one query's outcome; ``anchor`` is the inserted anchor (``None`` if none);
        ``cached_verdict``: rejected by rule (b) from the anchor cache, no samples drawn."""
        if reason not in REASONS:
            raise ValueError(f"acceptance reason {reason!r}: expected one of {REASONS}")
        if cached_verdict and reason != "no_reference_correct":
            raise ValueError(f"a cached verdict rejects for no_reference_correct, not {reason!r}")
        self.rejected_cached_no_ref_correct += int(cached_verdict)
        self.queries_seen += 1
        if reason == "accepted":
            self.accepted += 1
            if query_id is not None:
                self.accepted_ids.append(query_id)
        elif reason == "all_correct":
            self.rejected_all_correct += 1
        elif reason == "all_wrong":
            self.rejected_all_wrong += 1
        else:
            self.rejected_no_ref_correct += 1
        self.ref_samples += len(reference_samples)
        self.ref_correct += sum(bool(s.acc) for s in reference_samples)
        if anchor is not None:
            self.anchors += 1
            self.anchor_len_sum += anchor.response_len

    def as_metrics(self) -> dict[str, float]:
        """``anchor/*`` metrics; rates are 0 when their denominator is 0."""
        return {
            "anchor/gen_batches": float(self.gen_batches),
            "anchor/queries_seen": float(self.queries_seen),
            "anchor/accepted": float(self.accepted),
            "anchor/rejected_all_correct": float(self.rejected_all_correct),
            "anchor/rejected_all_wrong": float(self.rejected_all_wrong),
            "anchor/rejected_no_ref_correct": float(self.rejected_no_ref_correct),
            "anchor/rejected_cached_no_ref_correct": float(self.rejected_cached_no_ref_correct),
            "anchor/acceptance_rate": _ratio(self.accepted, self.queries_seen),
            "anchor/ref_acc": _ratio(self.ref_correct, self.ref_samples),
            "anchor/anchor_len_mean": _ratio(self.anchor_len_sum, self.anchors),
        }


def _ratio(num: float, den: float) -> float:
    return float(num) / den if den else 0.0
