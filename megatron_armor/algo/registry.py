"""The one map from config names to implementations (``algo.*`` settings).

Adding a variant is one class or function in its module, one line here, and its tests.
Config validation (``config/validate.py``) reads the names from here; the algorithm code
resolves names only through the ``get_*`` functions below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from megatron_armor.algo import (
    advantages,
    aggregation,
    anchors,
    kl,
    quatro,
    ratios,
    reset,
    rollout_correction,
)

RATIO_MODES: dict[str, type[ratios.StandardRatio]] = {
    "standard": ratios.StandardRatio,
    "mixed": ratios.MixedRatio,
    "off_policy": ratios.OffPolicyRatio,
    "static_expansion": ratios.StaticExpansionRatio,
}
"""``algo.ratio`` (docs/algorithm.md, mixed optimization)."""

ADVANTAGES: dict[str, advantages.AdvantageEstimator] = {
    "grpo": advantages.AdvantageEstimator(advantages.grpo_advantages),
    "qae": advantages.AdvantageEstimator(advantages.qae_advantages, {"quantile": "qae_quantile"}),
    "quatro": advantages.AdvantageEstimator(
        quatro.quatro_advantages,
        {
            "delta": "quatro.delta",
            "lambda_min": "quatro.lambda_min",
            "lambda_max": "quatro.lambda_max",
        },
    ),
}
"""``algo.advantage`` (docs/algorithm.md, advantages; ``quatro``: docs/algorithm.md) and the ``algo.*`` keys of
each estimator's hyperparameters."""

AGGREGATIONS: dict[str, type[aggregation.TokenMean]] = {
    "token-mean": aggregation.TokenMean,
    "seq-mean-token-mean": aggregation.SeqMeanTokenMean,
    "seq-mean-token-sum": aggregation.SeqMeanTokenSum,
}
"""``algo.loss_agg`` (docs/algorithm.md, mixed optimization)."""

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl.kl_k1,
    "k2": kl.kl_k2,
    "k3": kl.kl_k3,
}
"""``algo.kl_estimator``."""

ANCHOR_MODES: dict[str, anchors.AnchorMode] = {
    "none": anchors.NONE,
    "armor": anchors.ARMOR,
    "filter_only": anchors.FILTER_ONLY,
}
"""``algo.anchor`` (docs/algorithm.md, anchor rollout)."""

ANCHOR_SOURCES: dict[str, anchors.AnchorSource] = {
    "generate": anchors.GENERATE,
    "cache": anchors.CACHE,
}
"""``algo.anchor_source`` (docs/algorithm.md, anchor rollout)."""

SHORT_BATCH_POLICIES: dict[str, anchors.ShortBatchPolicy] = {
    "error": anchors.STOP_ON_SHORT,
    "train_partial": anchors.TRAIN_PARTIAL,
}
"""``algo.on_short_batch`` (docs/algorithm.md, anchor rollout: short batches)."""

FILTER_POLICY_SAMPLES: dict[str, int] = anchors.FILTER_POLICY_SAMPLES
"""``algo.filter_policy_samples`` (read by :meth:`~megatron_armor.algo.anchors.AnchorMode.policy_samples`)."""

RESET_SCHEDULES: dict[str, Callable[[int, int, int], bool]] = {
    "none": reset.never,
    "every": reset.every_tau,
    "every-until": reset.every_until,
    "log2": reset.power_of_two,
}
"""``algo.reset.schedule`` (docs/algorithm.md, reference reset)."""

ROLLOUT_CORRECTIONS: dict[str, rollout_correction.RolloutCorrection] = {
    "none": rollout_correction.NONE,
    "token_tis": rollout_correction.Truncated(),
    "seq_tis": rollout_correction.SequenceTruncated(),
    "token_mask": rollout_correction.Masked(),
    "seq_mask": rollout_correction.SequenceMasked(),
    "icepop": rollout_correction.IcePop(),
}
"""``algo.rollout_correction.mode`` (docs/algorithm.md, rollout correction)."""

SEQUENCE_RATIOS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "product": rollout_correction.product_log_ratio,
    "geometric": rollout_correction.geometric_log_ratio,
}
"""``algo.rollout_correction.seq_ratio``: the log sequence ratio ``[N]`` of the ``seq_*`` modes."""

ALGO_CHOICES: dict[str, dict] = {
    "algo.anchor": ANCHOR_MODES,
    "algo.anchor_source": ANCHOR_SOURCES,
    "algo.filter_policy_samples": FILTER_POLICY_SAMPLES,
    "algo.on_short_batch": SHORT_BATCH_POLICIES,
    "algo.ratio": RATIO_MODES,
    "algo.advantage": ADVANTAGES,
    "algo.loss_agg": AGGREGATIONS,
    "algo.kl_estimator": KL_ESTIMATORS,
    "algo.reset.schedule": RESET_SCHEDULES,
    "algo.rollout_correction.mode": ROLLOUT_CORRECTIONS,
    "algo.rollout_correction.seq_ratio": SEQUENCE_RATIOS,
}
"""Every ``algo.*`` setting that names a choice, and its table (a unit test keeps this, the
schema and docs/config.md in step)."""

T = TypeVar("T")


def lookup(table: dict[str, T], name: str, setting: str) -> T:
    """``table[name]``, or a ``ValueError`` naming ``setting``, the bad value and the valid names."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"{setting}={name!r}: unknown name; use one of {sorted(table)}") from None


def get_ratio(name: str) -> ratios.StandardRatio:
    """The ratio mode for ``algo.ratio``."""
    return lookup(RATIO_MODES, name, "algo.ratio")()


def get_advantage(name: str) -> advantages.AdvantageEstimator:
    """The estimator for ``algo.advantage`` (``.fn(scores[Q, G], **hparams) -> [Q, G]``)."""
    return lookup(ADVANTAGES, name, "algo.advantage")


def get_aggregation(name: str) -> aggregation.TokenMean:
    """The aggregation for ``algo.loss_agg``."""
    return lookup(AGGREGATIONS, name, "algo.loss_agg")()


def get_kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-token KL estimator ``f(logp, logq) -> [T]`` for ``algo.kl_estimator``."""
    return lookup(KL_ESTIMATORS, name, "algo.kl_estimator")


def get_anchor_mode(name: str) -> anchors.AnchorMode:
    """The :class:`~megatron_armor.algo.anchors.AnchorMode` for ``algo.anchor``."""
    return lookup(ANCHOR_MODES, name, "algo.anchor")


def get_short_batch_policy(name: str) -> anchors.ShortBatchPolicy:
    """The :class:`~megatron_armor.algo.anchors.ShortBatchPolicy` for ``algo.on_short_batch``."""
    return lookup(SHORT_BATCH_POLICIES, name, "algo.on_short_batch")


def get_anchor_source(name: str) -> anchors.AnchorSource:
    """The :class:`~megatron_armor.algo.anchors.AnchorSource` for ``algo.anchor_source``."""
    return lookup(ANCHOR_SOURCES, name, "algo.anchor_source")


def get_rollout_correction(name: str) -> rollout_correction.RolloutCorrection:
    """The :class:`~megatron_armor.algo.rollout_correction.RolloutCorrection` for
    ``algo.rollout_correction.mode``."""
    return lookup(ROLLOUT_CORRECTIONS, name, "algo.rollout_correction.mode")


def get_sequence_ratio(
    name: str,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(log_rho[T], loss_mask[T], sample_index[T]) -> [N]`` for
    ``algo.rollout_correction.seq_ratio``."""
    return lookup(SEQUENCE_RATIOS, name, "algo.rollout_correction.seq_ratio")
