"""Sample-based KL estimators (Schulman, "Approximating KL divergence").

Each estimator takes per-token log-probs ``logp`` of the sampling distribution ``p`` and
``logq`` of another distribution ``q`` at the *sampled* tokens, shapes ``[T] -> [T]``, and
returns a per-token estimate whose expectation under ``y ~ p`` approximates ``KL(p || q)``.
With ``x = logp - logq``:

- ``k1 = x``                      unbiased, high variance, can be negative
- ``k2 = x**2 / 2``               biased, low variance, >= 0
- ``k3 = exp(-x) - 1 + x``        unbiased, low variance, >= 0
"""

from __future__ import annotations

import torch


def kl_k1(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``k1 = logp - logq`` (unbiased estimate of ``KL(p || q)`` for ``y ~ p``)."""
    return logp - logq


def kl_k2(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``k2 = (logp - logq)**2 / 2``."""
    return 0.5 * (logp - logq) ** 2


def kl_k3(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(logq - logp) - 1 - (logq - logp)`` (unbiased, non-negative)."""
    log_r = logq - logp
    return torch.expm1(log_r) - log_r


def exact_kl(
    logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``(KL(p || q), KL(q || p))`` per row over the whole vocabulary, ``[N, V] -> [N]``,
    with ``p = softmax(logits_p / T)`` and ``q = softmax(logits_q / T)`` (float64 math).

    The reference for the vocab-parallel version in ``trainer/logprobs.py`` (docs/metrics.md,
    the per-position diagnostic of the paper's Fig. 2).
    """
    logp = torch.log_softmax(logits_p.double() / temperature, dim=-1)
    logq = torch.log_softmax(logits_q.double() / temperature, dim=-1)
    diff = logp - logq
    return (logp.exp() * diff).sum(-1), (logq.exp() * -diff).sum(-1)
