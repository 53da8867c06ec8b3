"""Importance ratios of the PPO surrogate (docs/algorithm.md, mixed optimization), one class per ``algo.ratio`` mode.

Every mode returns the *log* ratio per token; :func:`~megatron_armor.algo.losses.compute_policy_loss`
clamps it to ``±log_ratio_clamp`` and exponentiates, so all modes share one clamp. Inputs are
packed per-token tensors ``[T]`` (``types.TrainBatch``): ``logprobs`` = ``lp_theta`` (with
grad), ``old_logprobs`` = ``lp_old``, ``ref_logprobs`` = ``lp_ref``, ``is_anchor`` (bool).

A mode is a short specialization of :class:`StandardRatio`: it overrides ``log_ratio`` and/or
``clip_range``. Names are mapped to classes in ``registry.py``.
"""

from __future__ import annotations

import math

import torch


def resolve_alpha(alpha: float | str, group_size: int) -> float:
    """The mixing coefficient actually used (docs/algorithm.md, mixed optimization).

    ``'auto'`` -> ``n_on / (n_on + 1)`` with ``n_on = group_size - 1`` (15/16 for G = 16);
    a number is returned as a float after checking it lies in ``(0, 1]``.
    """
    if isinstance(alpha, str):
        if alpha != "auto":
            raise ValueError(f"algo.alpha={alpha!r}: use a number in (0, 1] or 'auto'")
        if group_size < 2:
            raise ValueError(f"algo.group_size={group_size}: alpha='auto' needs group_size >= 2")
        n_on = group_size - 1
        return n_on / (n_on + 1)
    if isinstance(alpha, bool):
        raise ValueError(f"algo.alpha={alpha!r}: use a number in (0, 1] or 'auto'")
    value = float(alpha)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"algo.alpha={alpha!r}: must lie in (0, 1] (or be 'auto')")
    return value


def mixed_logprob(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, alpha: float) -> torch.Tensor:
    """``log(alpha * pi + (1 - alpha) * pi_ref)`` per token, in log space (ARMOR Eq. 5).

    ``m = logsumexp(log(alpha) + lp, log(1 - alpha) + lp_ref)``; shapes ``[T] -> [T]``.
    With ``alpha = 1`` the second term is ``-inf`` and ``m == lp`` bit for bit.
    """
    log_a = math.log(alpha)
    log_1ma = math.log1p(-alpha) if alpha < 1.0 else -math.inf
    terms = torch.stack([logprobs + log_a, ref_logprobs + log_1ma])
    return torch.logsumexp(terms, dim=0)


class StandardRatio:
    """``standard``: ``log r = lp_theta - lp_old``; clip range ``[1 - eps_low, 1 + eps_high]``."""

    name = "standard"
    uses_reference_logprobs = False
    """Whether :meth:`log_ratio` reads ``ref_logprobs`` (the trainer then computes ``lp_ref``)."""
    mixes_reference = False
    """Whether every token's ratio mixes in ``pi_ref`` (ARMOR Eq. 5), the mixed optimization
    the filter-only control leaves out."""
    differs_on_anchors_only = False
    """Whether the ratio differs from ``standard`` only on anchor tokens (so it needs an
    ``algo.anchor`` that inserts them)."""

    def log_ratio(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor,
        is_anchor: torch.Tensor,
        alpha: float,
    ) -> torch.Tensor:
        """Per-token log ratio ``[T]`` (unclamped)."""
        return logprobs - old_logprobs

    def clip_range(self, clip_low: float, clip_high: float, alpha: float) -> tuple[float, float]:
        """``(lower, upper)`` bounds of ``clip(r, lower, upper)``."""
        return 1.0 - clip_low, 1.0 + clip_high


class MixedRatio(StandardRatio):
    """``mixed`` (ARMOR Eq. 5): ``log r = m_theta - m_old`` with ``m = log(alpha pi + (1-alpha) pi_ref)``.

    Applied to every token, anchor included. Identities (docs/algorithm.md, mixed optimization): ``alpha = 1`` gives the
    standard ratio exactly; in probability space ``exp(m_theta) - exp(m_old) =
    alpha (pi_theta - pi_old)``; with ``pi_ref == pi_old``, ``r = alpha * r_std + (1 - alpha)``.
    """

    name = "mixed"
    uses_reference_logprobs = True
    mixes_reference = True

    def log_ratio(self, logprobs, old_logprobs, ref_logprobs, is_anchor, alpha):
        m_theta = mixed_logprob(logprobs, ref_logprobs, alpha)
        m_old = mixed_logprob(old_logprobs, ref_logprobs, alpha)
        return m_theta - m_old


class OffPolicyRatio(StandardRatio):
    """``off_policy`` (ablation c): on-policy tokens ``lp_theta - lp_old``, anchor tokens ``lp_theta - lp_ref``."""

    name = "off_policy"
    uses_reference_logprobs = True
    differs_on_anchors_only = True

    def log_ratio(self, logprobs, old_logprobs, ref_logprobs, is_anchor, alpha):
        behaviour = torch.where(is_anchor, ref_logprobs, old_logprobs)
        return logprobs - behaviour


class StaticExpansionRatio(StandardRatio):
    """``static_expansion`` (ablation b): standard ratio, clip range ``[1 - eps_low/alpha, 1 + eps_high/alpha]``."""

    name = "static_expansion"

    def clip_range(self, clip_low, clip_high, alpha):
        return 1.0 - clip_low / alpha, 1.0 + clip_high / alpha
