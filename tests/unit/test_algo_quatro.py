"""QUATRO's per-query trust-region duals (algo/quatro.py, docs/algorithm.md). Tier: unit.

Properties that hold for any correct solution of the trust-region problem, not hand values.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_armor.algo.advantages import AdvantageEstimator, compute_advantages
from megatron_armor.algo.quatro import (
    dual_variables,
    kl_slope,
    kl_to_uniform,
    quatro_advantages,
    solve_lambda,
)
from megatron_armor.algo.registry import get_advantage
from megatron_armor.config.schema import AlgoConfig

pytestmark = pytest.mark.unit


def rewards(seed: int = 0, q: int = 16, n: int = 8) -> torch.Tensor:
    """Binary (+-1) and continuous rows, none constant."""
    g = torch.Generator().manual_seed(seed)
    binary = torch.where(torch.rand(q, n, generator=g) < 0.5, 1.0, -1.0).double()
    binary[:, 0], binary[:, 1] = 1.0, -1.0
    return torch.cat([binary, torch.randn(q, n, generator=g).double()])


def test_kl_of_the_reweighted_samples_equals_delta_where_the_constraint_binds():
    r = rewards()
    for delta in (0.01, 0.1, 0.3):
        lam = solve_lambda(r, delta, lambda_min=1e-3)
        binds = kl_to_uniform(r, torch.full_like(lam, 1e-3)) > delta
        kl = kl_to_uniform(r, lam)
        assert torch.allclose(kl[binds], torch.full_like(kl[binds], delta), atol=1e-9)
        assert (kl[~binds] <= delta).all() and (lam[~binds] == 1e-3).all()
    assert binds.sum() >= 20 and (~binds).sum() >= 1  # delta = 0.3: 6 of 8 correct cannot bind


def test_non_binding_constraint_clamps_lambda_to_its_minimum():
    """One correct of 8: KL(w || uniform) <= log 8; a radius above it never binds."""
    r = torch.tensor([[1.0] + [-1.0] * 7], dtype=torch.float64)
    assert solve_lambda(r, delta=math.log(8) + 0.5, lambda_min=1e-3).item() == pytest.approx(1e-3)


def test_lambda_decreases_as_delta_grows():
    r = rewards()
    lams = torch.stack([solve_lambda(r, d) for d in (0.02, 0.05, 0.1, 0.2, 0.4)])
    assert (lams[1:] < lams[:-1]).all()


def test_equal_rewards_give_zero_advantage():
    r = torch.tensor([[1.0] * 8, [-1.0] * 8, [0.3] * 8], dtype=torch.float64)
    assert quatro_advantages(r, delta=0.1).abs().max().item() == 0.0


def test_advantage_order_follows_reward_order():
    r = rewards()
    adv = quatro_advantages(r, delta=0.1)
    for row_r, row_a in zip(r, adv, strict=True):
        order = torch.argsort(row_r)
        assert (row_a[order].diff() >= -1e-12).all()
        ties = row_r[:, None] == row_r[None, :]
        assert torch.allclose(
            row_a[:, None].expand(-1, 8)[ties], row_a[None, :].expand(8, -1)[ties]
        )
    assert ((adv > 0) == (r > r.mean(-1, keepdim=True))).float().mean() > 0.9


def test_advantage_is_the_log_density_ratio_of_the_dual_solution():
    """``A = (R - (lambda + mu)) / lambda``, and ``exp(A) / N`` is a distribution."""
    r = rewards()
    lam, mu = dual_variables(r, 0.1)
    adv = quatro_advantages(r, delta=0.1)
    assert torch.allclose(adv, (r - (lam + mu)[:, None]) / lam[:, None], atol=1e-9)
    assert torch.allclose(adv.exp().mean(-1), torch.ones(r.shape[0], dtype=torch.float64))


def test_lambda_minimises_the_dual():
    """``g(lambda) = lambda * delta + lambda * log mean exp(R / lambda)`` is smallest at lambda*."""
    r, delta = rewards(seed=2), 0.1

    def dual(lam: torch.Tensor) -> torch.Tensor:
        return lam * delta + lam * (torch.logsumexp(r / lam[:, None], -1) - math.log(r.shape[-1]))

    lam = solve_lambda(r, delta)
    for factor in (0.9, 0.99, 1.01, 1.1):
        assert (dual(lam * factor) > dual(lam)).all()


def test_kl_slope_matches_float64_finite_differences():
    r = rewards(seed=3)
    lam = torch.linspace(0.2, 3.0, r.shape[0], dtype=torch.float64)
    h = 1e-6
    numeric = (kl_to_uniform(r, lam + h) - kl_to_uniform(r, lam - h)) / (2 * h)
    assert torch.allclose(kl_slope(r, lam), numeric, rtol=1e-6, atol=1e-9)
    assert (kl_slope(r, lam) < 0).all()


def test_vectorised_rows_match_one_query_at_a_time():
    r = rewards(seed=4)
    batched = quatro_advantages(r, delta=0.2)
    single = torch.cat([quatro_advantages(row[None], delta=0.2) for row in r])
    assert torch.allclose(batched, single, atol=1e-12)


def test_registry_reads_its_hyperparameters_from_algo_quatro():
    algo = AlgoConfig(advantage="quatro")
    algo.quatro.delta = 0.3
    estimator = get_advantage("quatro")
    assert isinstance(estimator, AdvantageEstimator)
    assert estimator.hparams(algo) == {"delta": 0.3, "lambda_min": 1e-3, "lambda_max": 1e4}
    assert get_advantage("qae").hparams(algo) == {"quantile": 0.45}
    scores = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    adv = compute_advantages(scores, "quatro", **estimator.hparams(algo))
    assert adv.shape == (5,) and adv.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [({"delta": 0.0}, "algo.quatro.delta=0.0"), ({"lambda_min": 2e4}, "algo.quatro.lambda_min")],
)
def test_bad_hyperparameters_name_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quatro_advantages(rewards(), **kwargs)
