"""The ARMOR policy loss: dual-clip PPO with clip-higher over a chosen ratio (docs/algorithm.md, mixed optimization).

Per response token ``t`` with advantage ``A``, ratio ``r`` (mode from ``algo.ratio``, log
ratio clamped to ``±log_ratio_clamp``) and clip range ``[lo, hi]`` (``1 - eps_low``,
``1 + eps_high`` unless the mode widens it)::

    l_t = max(-A r, -A clip(r, lo, hi))          # PPO, DAPO clip-higher (eps_high > eps_low)
    l_t = min(l_t, -A c)            if A < 0     # dual clip, c = dual_clip_c > 1
    l_t = w_t l_t                                # rollout correction (none: no weight)
    l_t += beta * k(lp_theta, lp_ref)            # optional KL penalty, on-policy tokens only

with ``w_t`` the detached weight of ``algo.rollout_correction`` (``rollout_correction.py``),
then aggregated (``algo.loss_agg``) as a local sum over an explicit global ``normalizer``.
Inputs are packed per-token tensors ``[T]`` (``types.TrainBatch``); a micro-batch holds whole
samples. Metrics are local *sums* (see :data:`METRIC_COUNTS` / :func:`finalize_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from megatron_armor.algo import registry
from megatron_armor.algo.kl import kl_k1, kl_k3
from megatron_armor.algo.rollout_correction import CorrectionSettings, behaviour_log_ratio


@dataclass(frozen=True)
class LossSettings:
    """The loss's view of the ``algo`` config section: the fields below of the same names
    (:meth:`from_algo_config`), already validated, with ``alpha`` as the config decided it
    (``config.resolved.alpha``), plus ``ref_metrics``. Defaults are ARMOR's (docs/algorithm.md)."""

    ratio: str = "mixed"
    """Ratio mode: ``standard`` | ``mixed`` | ``off_policy`` | ``static_expansion``."""
    alpha: float = 15 / 16
    """Mixing coefficient in (0, 1] (also scales the ``static_expansion`` clip range)."""
    clip_low: float = 0.2
    """``eps_low`` in (0, 1)."""
    clip_high: float = 0.28
    """``eps_high`` > 0 (clip-higher)."""
    dual_clip_c: float = 10.0
    """Dual-clip bound ``c`` > 1 for negative advantages."""
    log_ratio_clamp: float = 20.0
    """``|log r|`` is clamped to this before ``exp`` (all modes)."""
    loss_agg: str = "token-mean"
    """``token-mean`` | ``seq-mean-token-mean`` | ``seq-mean-token-sum``."""
    kl_coef: float = 0.0
    """``beta`` of the optional KL(pi_theta || pi_ref) penalty (0 = off)."""
    kl_estimator: str = "k3"
    """``k1`` | ``k2`` | ``k3``."""
    ref_metrics: bool = True
    """Log ``kl/*`` metrics (needs ``ref_logprobs``; set False when they are not computed)."""
    rollout_correction: CorrectionSettings = field(default_factory=CorrectionSettings)
    """``algo.rollout_correction``: the engine/trainer mismatch weight (default ``none``)."""

    @classmethod
    def from_algo_config(cls, algo, alpha: float, ref_metrics: bool | None = None
                         ) -> LossSettings:  # fmt: skip
        """The settings of a validated ``algo`` config section (any object with the ``algo.*``
        attributes): each field read from the attribute of its name, but ``alpha``: the
        number its setting stands for (``config.resolved.alpha``).

        ``ref_metrics`` defaults to :func:`needs_reference_logprobs`: the ``kl/*`` metrics are
        logged exactly when the reference log-probs are computed.
        """
        if ref_metrics is None:
            ref_metrics = needs_reference_logprobs(algo)
        own = ("alpha", "ref_metrics", "rollout_correction")
        names = [f.name for f in fields(cls) if f.name not in own]
        correction = CorrectionSettings.from_config(algo.rollout_correction)
        return cls(**{name: getattr(algo, name) for name in names}, alpha=alpha,
                   ref_metrics=ref_metrics, rollout_correction=correction)  # fmt: skip


def needs_reference_logprobs(algo) -> bool:
    """Whether a step needs ``lp_ref`` (docs/algorithm.md, mixed optimization; docs/metrics.md): the mixed and off-policy ratios,
    the KL penalty, and the reference-KL metrics of runs that sample anchors."""
    return (
        registry.get_ratio(algo.ratio).uses_reference_logprobs
        or algo.kl_coef > 0
        or registry.get_anchor_mode(algo.anchor).draws_reference
    )


METRIC_COUNTS: dict[str, str] = {
    "loss/pg": "count/tokens",
    "loss/clipfrac_low": "count/tokens",
    "loss/clipfrac_high": "count/tokens",
    "loss/dualclip_frac": "count/tokens",
    "loss/ratio_mean": "count/tokens",
    "loss/anchor_ratio_mean": "count/anchor_tokens",
    "loss/approx_kl": "count/policy_tokens",
    "loss/kl_penalty": "count/policy_tokens",
    "loss/entropy": "count/tokens",
    "kl/reverse_k1": "count/policy_tokens",
    "kl/reverse_k3": "count/policy_tokens",
    "kl/forward_k1": "count/anchor_tokens",
    "correction/policy_weight_mean": "count/policy_tokens",
    "correction/policy_cut_frac": "count/policy_tokens",
    "correction/anchor_weight_mean": "count/anchor_tokens",
    "correction/anchor_cut_frac": "count/anchor_tokens",
}
"""Each summed metric -> the count key it is divided by in :func:`finalize_metrics`."""

MAX_COUNTS: dict[str, str] = {
    "correction/policy_weight_max": "count/policy_tokens",
    "correction/anchor_weight_max": "count/anchor_tokens",
}
"""Maxima over a subset of the tokens -> the count of that subset: kept only when it is > 0."""


def dual_clip_pg_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, lower: float, upper: float, dual_clip_c: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token dual-clip PPO loss ``[T]`` and boolean flags ``[T]`` of which clip is active.

    Flags: ``clip_low`` (``A < 0`` and ``r < lower``: gradient cut), ``clip_high`` (``A > 0``
    and ``r > upper``: gradient cut), ``dual`` (``A < 0`` and the ``-A c`` bound is taken).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(lower, upper)
    ppo = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * dual_clip_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(ppo, dual_bound), ppo)
    flags = {
        "clip_low": negative & (ratio < lower),
        "clip_high": (advantages > 0) & (ratio > upper),
        "dual": negative & (ppo > dual_bound),
    }
    return loss, flags


def compute_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    is_anchor: torch.Tensor,
    sample_index: torch.Tensor,
    settings: LossSettings,
    normalizer: float,
    entropy: torch.Tensor | None = None,
    engine_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Local loss (0-dim, with grad) and local metric sums for one micro-batch.

    The per-token inputs ``[T]`` after ``logprobs`` and ``engine_logprobs`` are the entries of
    the packed batch's ``token_data`` (``types.pack_groups``), passed by name
    (``trainer/schedule.py``), plus ``sample_index``; a new per-token input is a new entry
    there and a new argument here. ``engine_logprobs`` (the rollout engine's own log-prob of
    each token) is read only by a rollout correction that applies.

    ``normalizer`` is the GLOBAL number of aggregation units of the mini-batch (masked
    tokens for ``token-mean``, samples with response tokens for ``seq-mean-*``; see
    :func:`count_units`), so summing the returned losses over micro-batches and DP ranks
    gives the mini-batch loss; a rollout correction leaves it as it is (a masked token counts
    with weight 0). ``entropy`` ``[T]`` (optional) is only logged.
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer={normalizer}: must be the global unit count (> 0)")
    is_anchor = is_anchor.bool()
    mode = registry.get_ratio(settings.ratio)
    log_ratio = mode.log_ratio(logprobs, old_logprobs, ref_logprobs, is_anchor, settings.alpha)
    log_ratio = log_ratio.clamp(-settings.log_ratio_clamp, settings.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    lower, upper = mode.clip_range(settings.clip_low, settings.clip_high, settings.alpha)
    pg, flags = dual_clip_pg_loss(ratio, advantages, lower, upper, settings.dual_clip_c)
    mask = loss_mask.to(pg.dtype)
    policy_mask = mask * (~is_anchor).to(pg.dtype)
    correction = correction_weights(
        old_logprobs, ref_logprobs, engine_logprobs, is_anchor, mask, sample_index, settings
    )
    per_token = pg if correction is None else pg * correction[0]
    kl_term = None
    if settings.kl_coef > 0:
        kl_term = registry.get_kl_estimator(settings.kl_estimator)(logprobs, ref_logprobs)
        # where(), not a product: unused positions may hold non-finite log-probs
        kl_term = torch.where(policy_mask > 0, kl_term, torch.zeros_like(kl_term))
        per_token = per_token + settings.kl_coef * kl_term
    loss = registry.get_aggregation(settings.loss_agg).reduce(
        per_token, mask, sample_index, normalizer
    )
    metrics = _metrics(
        pg, ratio, flags, mask, policy_mask, old_logprobs, ref_logprobs, log_ratio, settings
    )
    if correction is not None:
        metrics.update(correction_metrics(*correction, policy_mask, mask - policy_mask))
    if kl_term is not None:
        metrics["loss/kl_penalty"] = kl_term.detach().sum()
    if entropy is not None:
        metrics["loss/entropy"] = _masked_sum(entropy.detach(), mask)
    return loss, metrics


def correction_weights(
    old_logprobs, ref_logprobs, engine_logprobs, is_anchor, mask, sample_index, settings
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(w, cut)`` ``[T]`` of ``settings.rollout_correction`` (``rollout_correction.py``):
    detached weights (0 off the mask) and which tokens were truncated or masked; ``None``
    for ``mode: none``."""
    s = settings.rollout_correction
    correction = registry.get_rollout_correction(s.mode)
    if not correction.applies:
        return None
    if engine_logprobs is None:
        raise ValueError(
            f"algo.rollout_correction.mode={s.mode!r} needs the engine's log-probs of every "
            "token (the token_data entry engine_logprobs of types.pack_groups)"
        )
    with torch.no_grad():
        log_rho = behaviour_log_ratio(old_logprobs, ref_logprobs, engine_logprobs, is_anchor)
        seq_ratio = registry.get_sequence_ratio(s.seq_ratio)
        return correction.weights(log_rho.to(mask.dtype), mask, sample_index, s, seq_ratio)


def correction_metrics(weights, cut, policy_mask, anchor_mask) -> dict[str, torch.Tensor]:
    """``correction/{policy,anchor}_{weight_mean,weight_max,cut_frac}`` as local sums (means)
    and maxima; ``finalize_metrics`` divides by the source's token count."""
    out = {}
    for source, sel in (("policy", policy_mask), ("anchor", anchor_mask)):
        out[f"correction/{source}_weight_mean"] = _masked_sum(weights, sel)
        out[f"correction/{source}_cut_frac"] = _masked_sum(cut.to(sel.dtype), sel)
        chosen = torch.where(sel > 0, weights, torch.zeros_like(weights))
        out[f"correction/{source}_weight_max"] = chosen.max() if chosen.numel() else sel.sum()
    return out


def _metrics(pg, ratio, flags, mask, policy_mask, old_logprobs, ref_logprobs, log_ratio, settings):
    """Local sums (and maxima) over masked tokens; all detached 0-dim tensors."""
    pg, ratio, log_ratio = pg.detach(), ratio.detach(), log_ratio.detach()
    anchor_mask = mask - policy_mask
    masked_ratio = torch.where(mask > 0, ratio, torch.zeros_like(ratio))
    metrics = {
        "loss/pg": _masked_sum(pg, mask),
        "loss/clipfrac_low": _masked_sum(flags["clip_low"].to(mask.dtype), mask),
        "loss/clipfrac_high": _masked_sum(flags["clip_high"].to(mask.dtype), mask),
        "loss/dualclip_frac": _masked_sum(flags["dual"].to(mask.dtype), mask),
        "loss/ratio_mean": _masked_sum(ratio, mask),
        "loss/ratio_max": masked_ratio.max() if ratio.numel() else ratio.new_zeros(()),
        "loss/anchor_ratio_mean": _masked_sum(ratio, anchor_mask),
        # k3 estimate of KL(behaviour || target) of the ratio in use, on-policy tokens only
        "loss/approx_kl": _masked_sum(kl_k3(torch.zeros_like(log_ratio), log_ratio), policy_mask),
        "count/tokens": mask.sum(),
        "count/anchor_tokens": anchor_mask.sum(),
        "count/policy_tokens": policy_mask.sum(),
    }
    if settings.ref_metrics:
        metrics.update(_reference_kl_metrics(old_logprobs, ref_logprobs, policy_mask, anchor_mask))
    return metrics


def _reference_kl_metrics(old_logprobs, ref_logprobs, policy_mask, anchor_mask):
    """``kl/reverse_*``: KL(pi_old || pi_ref) on on-policy tokens (y ~ pi_old);
    ``kl/forward_k1``: KL(pi_ref || pi_old) on anchor tokens (y ~ pi_ref, accepted anchors only)."""
    old, ref = old_logprobs.detach(), ref_logprobs.detach()
    return {
        "kl/reverse_k1": _masked_sum(kl_k1(old, ref), policy_mask),
        "kl/reverse_k3": _masked_sum(kl_k3(old, ref), policy_mask),
        "kl/forward_k1": _masked_sum(kl_k1(ref, old), anchor_mask),
    }


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t values_t`` over ``mask_t > 0``; values elsewhere (possibly non-finite) are ignored."""
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum()


def count_units(loss_agg: str, loss_mask: torch.Tensor, sample_index: torch.Tensor) -> int:
    """Local aggregation units of a micro-batch; sum over micro-batches and DP ranks -> ``normalizer``."""
    return registry.get_aggregation(loss_agg).units(loss_mask, sample_index)


def finalize_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Turn globally reduced sums into means: ``m / sums[METRIC_COUNTS[m]]``.

    ``count/*`` and ``*_max`` keys pass through; a mean whose count is 0 is dropped (e.g. no
    anchor tokens), and so is a maximum of :data:`MAX_COUNTS` over no token; keys not in
    :data:`METRIC_COUNTS` pass through unchanged.
    """
    out: dict[str, float] = {}
    for key, value in sums.items():
        count_key = METRIC_COUNTS.get(key)
        if count_key is None:
            if sums.get(MAX_COUNTS.get(key, ""), 1.0) > 0:
                out[key] = float(value)
        elif sums.get(count_key, 0.0) > 0:
            out[key] = float(value) / float(sums[count_key])
    return out
