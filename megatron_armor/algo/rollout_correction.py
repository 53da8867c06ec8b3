"""Rollout correction: per-token weights for the gap between the engine that sampled a response
and the trainer that scores it (docs/algorithm.md, rollout correction), one object per
``algo.rollout_correction.mode``.

A response is drawn by an engine (SGLang or the embedded engine), whose per-token log-probs
``lp_e`` come with it (``types.Sample.response_logprobs``). The trainer recomputes the same
distribution itself: ``lp_old`` for on-policy samples (the policy engine sampled them) and
``lp_ref`` for anchors (the engine serving the reference sampled them). Per response token
``t`` of sample ``i``, with ``lp_b = lp_ref`` on anchor tokens and ``lp_old`` elsewhere::

    log rho_t = lp_b,t - lp_e,t                                       # token ratio
    log rho_i = sum_{t in i} log rho_t            (seq_ratio: product)   # sequence ratio
              = (1 / n_i) sum_{t in i} log rho_t  (seq_ratio: geometric)

and the mode's weight ``w_t`` (a sequence-level mode gives every token of ``i`` the weight of
``rho_i``)::

    none        no weight: the loss is left as it is
    token_tis   w_t = min(rho_t, C)                        truncated IS (Yao et al., 2025)
    seq_tis     w_t = min(rho_i, C)
    token_mask  w_t = 1[lo <= rho_t <= hi]                 rejection of outlier tokens
    seq_mask    w_t = 1[lo <= rho_i <= hi]                 rejection of outlier sequences
    icepop      w_t = rho_t 1[lo <= rho_t <= hi]           masked IS (IcePop, Ring-1T)

``C = cap``, ``lo = low``, ``hi = high``. The weight multiplies each token's clipped PPO term
(``algo/losses.py``) and is never differentiated: every input is a log-prob computed before the
update. Comparisons are made on log ratios (``log rho <= log hi``), so a sequence ratio that
overflows ``exp`` is still truncated or masked, never ``inf``. Shapes: every input ``[T]``
(packed tokens of whole samples, ``types.TrainBatch``), ``sample_index`` ``[T]`` 0-based.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_armor.algo.aggregation import per_sample_sums


@dataclass(frozen=True)
class CorrectionSettings:
    """The ``algo.rollout_correction`` section as the loss reads it (validated at load)."""

    mode: str = "none"
    """``none`` | ``token_tis`` | ``seq_tis`` | ``token_mask`` | ``seq_mask`` | ``icepop``."""
    cap: float = 2.0
    """``C`` of the truncating modes (``token_tis``, ``seq_tis``): ``w = min(rho, C)``."""
    low: float = 0.5
    """``lo`` of the masking modes (``token_mask``, ``seq_mask``, ``icepop``); 0 = no lower bound."""
    high: float = 2.0
    """``hi`` of the masking modes: a ratio above it gets weight 0."""
    seq_ratio: str = "product"
    """The sequence ratio of ``seq_tis`` / ``seq_mask``: ``product`` (``prod_t rho_t``, the
    sequence's likelihood ratio) | ``geometric`` (``(prod_t rho_t)^(1/n)``, length-free)."""

    @classmethod
    def from_config(cls, section) -> CorrectionSettings:
        """The settings of a loaded ``algo.rollout_correction`` section (read by field name)."""
        return cls(**{name: getattr(section, name) for name in cls.__dataclass_fields__})


def behaviour_log_ratio(
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    is_anchor: torch.Tensor,
) -> torch.Tensor:
    """``log rho_t = lp_b - lp_e`` ``[T]``: the trainer's log-prob of the distribution that
    drew the token (``lp_ref`` on anchor tokens, ``lp_old`` elsewhere) minus the engine's."""
    return torch.where(is_anchor.bool(), ref_logprobs, old_logprobs) - engine_logprobs


def product_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, index: torch.Tensor):
    """``log prod_{t in i} rho_t`` per sample ``[N]`` (masked tokens excluded)."""
    return per_sample_sums(torch.where(mask > 0, log_rho, torch.zeros_like(log_rho)), index)


def geometric_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, index: torch.Tensor):
    """``(1 / n_i) log prod_{t in i} rho_t`` per sample ``[N]`` (``n_i``: its masked tokens)."""
    counts = per_sample_sums((mask > 0).to(log_rho.dtype), index)
    return product_log_ratio(log_rho, mask, index) / counts.clamp(min=1.0)


class RolloutCorrection:
    """``none``: no weight (:attr:`applies` is false; the loss never calls :meth:`weights`)."""

    name = "none"
    applies = False
    """Whether the mode weights the loss (``none``: the loss is bit for bit the unweighted one)."""
    per_sequence = False
    """Whether the weight is one per sample, from the sequence ratio ``rho_i``."""

    def weights(
        self,
        log_rho: torch.Tensor,
        loss_mask: torch.Tensor,
        sample_index: torch.Tensor,
        settings: CorrectionSettings,
        seq_ratio,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w, cut)`` ``[T]``: the weight of every token (0 off the loss mask) and whether it
        was truncated or masked. ``seq_ratio`` is the registered sequence-ratio function of
        ``settings.seq_ratio`` (:func:`product_log_ratio` or :func:`geometric_log_ratio`)."""
        on = loss_mask > 0
        log_rho = torch.where(on, log_rho, torch.zeros_like(log_rho))
        if self.per_sequence:
            log_rho = seq_ratio(log_rho, loss_mask, sample_index)[sample_index]
        w, cut = self.weight(log_rho, settings)
        return torch.where(on, w, torch.zeros_like(w)), cut & on

    def weight(self, log_rho: torch.Tensor, s: CorrectionSettings):
        """``(w, cut)`` from the (token or sequence) log ratio of each token."""
        raise NotImplementedError(f"rollout correction {self.name!r} has no weight")


class Truncated(RolloutCorrection):
    """``token_tis``: ``w = min(rho, C)`` (truncated importance sampling)."""

    name = "token_tis"
    applies = True

    def weight(self, log_rho, s):
        log_cap = math.log(s.cap)
        return torch.exp(log_rho.clamp(max=log_cap)), log_rho > log_cap


class SequenceTruncated(Truncated):
    """``seq_tis``: ``w = min(rho_i, C)`` for every token of sample ``i``."""

    name = "seq_tis"
    per_sequence = True


class Masked(RolloutCorrection):
    """``token_mask``: ``w = 1[lo <= rho <= hi]`` (the ratio itself is not applied)."""

    name = "token_mask"
    applies = True

    def kept(self, log_rho: torch.Tensor, s: CorrectionSettings) -> torch.Tensor:
        """``lo <= rho <= hi``, compared in log space (``lo = 0``: no lower bound)."""
        low = math.log(s.low) if s.low > 0 else -math.inf
        return (log_rho >= low) & (log_rho <= math.log(s.high))

    def weight(self, log_rho, s):
        kept = self.kept(log_rho, s)
        return kept.to(log_rho.dtype), ~kept


class SequenceMasked(Masked):
    """``seq_mask``: ``w = 1[lo <= rho_i <= hi]`` for every token of sample ``i``."""

    name = "seq_mask"
    per_sequence = True


class IcePop(Masked):
    """``icepop``: ``w = rho 1[lo <= rho <= hi]`` (masked importance sampling)."""

    name = "icepop"

    def weight(self, log_rho, s):
        kept = self.kept(log_rho, s)
        rho = torch.exp(torch.where(kept, log_rho, torch.zeros_like(log_rho)))
        return torch.where(kept, rho, torch.zeros_like(rho)), ~kept


NONE = RolloutCorrection()
