"""QUATRO advantages: per-query dual variables of a KL trust region over the sampled rewards.

QUATRO (Query-Adaptive Trust-Region Policy Optimization) solves, for each query ``q`` with
``N`` responses drawn from ``pi_old`` and rewards ``R [N]``, the trust-region problem

    max_pi  E_pi[R]   s.t.  KL(pi || pi_old) <= delta,  sum(pi) = 1

on the empirical support (``pi_old`` = uniform over the ``N`` samples). With multipliers
``lambda >= 0`` (trust region) and ``mu`` (normalisation), stationarity gives

    log(pi*(i) / pi_old(i)) = (R_i - (lambda + mu)) / lambda  =: A_i,

so ``pi* = softmax(R / lambda)`` (weights ``w``), ``lambda + mu = lambda * log mean(exp(R / lambda))``
and ``A_i = log(N * w_i)``. ``lambda*`` minimises the dual ``g(lambda) = lambda * delta +
lambda * log mean(exp(R / lambda))``; ``g'(lambda) = delta - KL(w || uniform)``, so at the optimum

    KL(w(lambda*) || uniform) = delta          (when the constraint binds),

a 1-D root of a function decreasing in ``lambda``: ``d KL / d lambda = -Var_w(R) / lambda^3``.
It is solved per query, vectorised over queries, by Newton steps in ``u = log(lambda)`` kept
inside a bisection bracket ``[lambda_min, lambda_max]``. When ``delta`` exceeds
``KL(w(lambda_min) || uniform)`` the constraint does not bind inside the bracket and
``lambda = lambda_min`` (the unconstrained optimum is ``lambda -> 0``); equal rewards give
``w`` uniform and ``A = 0`` for any ``lambda``. The derivation is in docs/algorithm.md.
"""

from __future__ import annotations

import math

import torch


def kl_to_uniform(rewards: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(R / lambda) || uniform)`` per row: ``[Q, N], [Q] -> [Q]``."""
    logw = torch.log_softmax(rewards / lam.unsqueeze(-1), dim=-1)
    return (logw.exp() * (logw + math.log(rewards.shape[-1]))).sum(-1)


def kl_slope(rewards: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``d KL(softmax(R / lambda) || uniform) / d lambda = -Var_w(R) / lambda^3``; ``[Q]``."""
    w = torch.softmax(rewards / lam.unsqueeze(-1), dim=-1)
    mean = (w * rewards).sum(-1, keepdim=True)
    var = (w * (rewards - mean) ** 2).sum(-1)
    return -var / lam**3


def solve_lambda(
    rewards: torch.Tensor,
    delta: float,
    lambda_min: float = 1e-3,
    lambda_max: float = 1e4,
    iterations: int = 100,
) -> torch.Tensor:
    """``lambda*`` per query with ``KL(softmax(R / lambda*) || uniform) = delta``; ``[Q, N] -> [Q]``.

    Clamped to ``[lambda_min, lambda_max]``: ``lambda_min`` where the constraint does not bind
    there (``delta`` too large for the reward spread, equal rewards included).
    """
    r = rewards.to(torch.float64)
    lo = torch.full(r.shape[:1], math.log(lambda_min), dtype=torch.float64)
    hi = torch.full_like(lo, math.log(lambda_max))
    u = (lo + hi) / 2
    for _ in range(iterations):
        lam = u.exp()
        gap = kl_to_uniform(r, lam) - delta  # decreasing in u
        lo = torch.where(gap > 0, u, lo)
        hi = torch.where(gap > 0, hi, u)
        if ((gap.abs() < 1e-13) | (hi - lo < 1e-13)).all():
            break
        slope = kl_slope(r, lam) * lam  # d gap / d u
        newton = u - gap / torch.where(slope < 0, slope, torch.full_like(slope, -1.0))
        inside = (slope < 0) & (newton > lo) & (newton < hi)
        u = torch.where(inside, newton, (lo + hi) / 2)
    lam = u.exp()
    no_bind = kl_to_uniform(r, torch.full_like(lam, lambda_min)) <= delta
    far = kl_to_uniform(r, torch.full_like(lam, lambda_max)) >= delta
    lam = torch.where(no_bind, torch.full_like(lam, lambda_min), lam)
    return torch.where(far & ~no_bind, torch.full_like(lam, lambda_max), lam)


def dual_variables(
    rewards: torch.Tensor, delta: float, lambda_min: float = 1e-3, lambda_max: float = 1e4
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lambda*, mu*)`` per query: ``mu = lambda * log mean(exp(R / lambda)) - lambda``; ``[Q]``."""
    r = rewards.to(torch.float64)
    lam = solve_lambda(r, delta, lambda_min, lambda_max)
    log_mean_exp = torch.logsumexp(r / lam.unsqueeze(-1), dim=-1) - math.log(r.shape[-1])
    return lam, lam * log_mean_exp - lam


def quatro_advantages(
    scores: torch.Tensor,
    delta: float = 0.1,
    lambda_min: float = 1e-3,
    lambda_max: float = 1e4,
) -> torch.Tensor:
    """``A = (R - (lambda* + mu*)) / lambda* = log(N * softmax(R / lambda*))``; ``[Q, N] -> [Q, N]``.

    Rows whose rewards are all equal get exactly 0 (no update from a group without signal).
    """
    if delta <= 0:
        raise ValueError(
            f"algo.quatro.delta={delta}: the trust-region radius must be > 0, e.g. 0.1"
        )
    if not 0 < lambda_min < lambda_max:
        raise ValueError(
            f"algo.quatro.lambda_min={lambda_min}, lambda_max={lambda_max}: need "
            "0 < lambda_min < lambda_max, e.g. 1e-3 and 1e4"
        )
    r = scores.to(torch.float64)
    lam = solve_lambda(r, delta, lambda_min, lambda_max)
    adv = torch.log_softmax(r / lam.unsqueeze(-1), dim=-1) + math.log(r.shape[-1])
    flat = (r.amax(-1) - r.amin(-1)) == 0
    return torch.where(flat.unsqueeze(-1), torch.zeros_like(adv), adv)
