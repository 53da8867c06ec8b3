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
