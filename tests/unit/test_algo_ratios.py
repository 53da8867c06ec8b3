"""Ratio modes and the identities of docs/algorithm.md, mixed optimization. Tier: unit (pure torch, no devices)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_armor.algo.losses import LossSettings, compute_policy_loss
from megatron_armor.algo.ratios import (
    MixedRatio,
    OffPolicyRatio,
    StandardRatio,
    StaticExpansionRatio,
    mixed_logprob,
    resolve_alpha,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


def _probs(n: int, seed: int, low: float = 0.05, high: float = 0.95) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(n, generator=g, dtype=F64)


def test_resolve_alpha_auto_and_explicit():
    assert resolve_alpha("auto", 16) == 15 / 16
    assert resolve_alpha("auto", 2) == 0.5
    assert resolve_alpha(0.875, 16) == 0.875
    assert resolve_alpha(1, 16) == 1.0


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, "half"])
def test_resolve_alpha_rejects(bad):
    with pytest.raises(ValueError, match="alpha"):
        resolve_alpha(bad, 16)


def test_mixed_alpha_one_equals_standard_exactly():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, F64, torch.bfloat16):
        lp = -5 * torch.rand(64, generator=g).to(dtype)
        old = -5 * torch.rand(64, generator=g).to(dtype)
        ref = -5 * torch.rand(64, generator=g).to(dtype)
        anchor = torch.zeros(64, dtype=torch.bool)
        mixed = MixedRatio().log_ratio(lp, old, ref, anchor, 1.0)
        standard = StandardRatio().log_ratio(lp, old, ref, anchor, 1.0)
        assert torch.equal(mixed, standard)
        assert torch.equal(mixed_logprob(lp, ref, 1.0), lp)


def test_mixed_alpha_one_loss_and_grad_equal_standard():
    g = torch.Generator().manual_seed(1)
    n = 40
    base = -4 * torch.rand(n, generator=g)
    old = base + 0.3 * torch.randn(n, generator=g)
    old[0] = base[0] - 30.0  # beyond the clamp: both modes clamp the same way
    ref = -4 * torch.rand(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).float()
    anchor = torch.zeros(n, dtype=torch.bool)
    anchor[-8:] = True
    index = torch.arange(n) // 8
    results = []
    for ratio in ("standard", "mixed"):
        lp = base.clone().requires_grad_(True)
        settings = LossSettings(ratio=ratio, alpha=1.0)
        loss, metrics = compute_policy_loss(lp, old, ref, adv, mask, anchor, index, settings, 32.0)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (l_std, g_std, m_std), (l_mix, g_mix, m_mix) = results
    assert torch.equal(l_std, l_mix)
    assert torch.equal(g_std, g_mix)
    for key in m_std:
        assert torch.equal(m_std[key], m_mix[key]), key


@pytest.mark.parametrize("alpha", [15 / 16, 0.875, 0.5, 0.1])
def test_delta_mix_is_alpha_delta_theta(alpha):
    """With pi_ref fixed: exp(m_theta) - exp(m_old) = alpha (pi_theta - pi_old)."""
    pi_theta, pi_old, pi_ref = _probs(50, 1), _probs(50, 2), _probs(50, 3)
    m_theta = mixed_logprob(pi_theta.log(), pi_ref.log(), alpha)
    m_old = mixed_logprob(pi_old.log(), pi_ref.log(), alpha)
    delta_mix = m_theta.exp() - m_old.exp()
    torch.testing.assert_close(delta_mix, alpha * (pi_theta - pi_old), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("alpha", [15 / 16, 0.875, 0.5])
@pytest.mark.parametrize("eps", [0.2, 0.28])
def test_clip_boundary_eq6(alpha, eps):
    """r_mix = 1 ± eps exactly at pi_theta = (1 ± eps) pi_old ± eps (1-alpha)/alpha pi_ref."""
    pi_old = _probs(30, 4, 0.3, 0.6)
    pi_ref = _probs(30, 5, 0.01, 0.2)
    for sign in (+1.0, -1.0):
        pi_theta = (1 + sign * eps) * pi_old + sign * eps * (1 - alpha) / alpha * pi_ref
        log_r = MixedRatio().log_ratio(
            pi_theta.log(), pi_old.log(), pi_ref.log(), torch.zeros(30, dtype=torch.bool), alpha
        )
        torch.testing.assert_close(log_r.exp(), torch.full_like(log_r, 1 + sign * eps))


def test_clip_boundary_eq6_cuts_gradient_beyond_boundary():
    """A > 0: the gradient vanishes just past the Eq. 6 upper boundary, not before it."""
    alpha, eps = 0.875, 0.28
    pi_old, pi_ref = torch.tensor([0.4], dtype=F64), torch.tensor([0.1], dtype=F64)
    boundary = (1 + eps) * pi_old + eps * (1 - alpha) / alpha * pi_ref
    settings = LossSettings(ratio="mixed", alpha=alpha, clip_high=eps)
    grads = []
    for pi_theta in (boundary - 1e-4, boundary + 1e-4):
        lp = pi_theta.log().requires_grad_(True)
        loss, _ = compute_policy_loss(
            lp,
            pi_old.log(),
            pi_ref.log(),
            torch.ones(1, dtype=F64),
            torch.ones(1, dtype=F64),
            torch.zeros(1, dtype=torch.bool),
            torch.zeros(1, dtype=torch.long),
            settings,
            1.0,
        )
        loss.backward()
        grads.append(lp.grad.item())
    assert grads[0] < 0 and grads[1] == 0.0
    # the standard ratio would already be clipped at pi_theta > (1 + eps) pi_old
    assert ((1 + eps) * pi_old < boundary - 1e-4).all()


@pytest.mark.parametrize("alpha", [15 / 16, 0.875, 0.3])
def test_ref_equal_old_gives_affine_ratio(alpha):
    """pi_ref == pi_old: r_mix = alpha r + (1 - alpha)."""
    lp, old = _probs(40, 6).log(), _probs(40, 7).log()
    log_r = MixedRatio().log_ratio(lp, old, old, torch.zeros(40, dtype=torch.bool), alpha)
    expected = alpha * (lp - old).exp() + (1 - alpha)
    torch.testing.assert_close(log_r.exp(), expected, rtol=1e-12, atol=1e-14)


def test_mixed_hand_value():
    """alpha=0.5, pi=0.2, pi_old=0.1, pi_ref=0.3: r = (0.1+0.15)/(0.05+0.15) = 1.25."""
    lp, old, ref = (torch.tensor([p], dtype=F64).log() for p in (0.2, 0.1, 0.3))
    log_r = MixedRatio().log_ratio(lp, old, ref, torch.zeros(1, dtype=torch.bool), 0.5)
    assert log_r.exp().item() == pytest.approx(1.25, rel=1e-12)


def test_mixed_ratio_gradcheck_float64():
    g = torch.Generator().manual_seed(7)
    lp = (-3 * torch.rand(12, generator=g, dtype=F64)).requires_grad_(True)
    old = -3 * torch.rand(12, generator=g, dtype=F64)
    ref = -3 * torch.rand(12, generator=g, dtype=F64)
    anchor = torch.zeros(12, dtype=torch.bool)

    def ratio(x):
        return MixedRatio().log_ratio(x, old, ref, anchor, 0.875).exp()

    assert torch.autograd.gradcheck(ratio, (lp,), eps=1e-6, atol=1e-8)
    # analytic: d r / d lp = alpha pi_theta / (alpha pi_old + (1 - alpha) pi_ref)
    jac = torch.autograd.functional.jacobian(ratio, lp.detach())
    expected = 0.875 * lp.detach().exp() / (0.875 * old.exp() + 0.125 * ref.exp())
    torch.testing.assert_close(torch.diagonal(jac), expected)


def test_mixed_loss_gradient_matches_finite_differences():
    """Whole loss in the unclipped region (ratios near 1) vs central differences."""
    g = torch.Generator().manual_seed(8)
    n = 10
    old = -2 - torch.rand(n, generator=g, dtype=F64)
    lp = (old + 0.01 * torch.randn(n, generator=g, dtype=F64)).requires_grad_(True)
    ref = -2 - torch.rand(n, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    mask = torch.ones(n, dtype=F64)
    anchor = torch.arange(n) >= 8
    index = torch.arange(n) // 5
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        settings = LossSettings(ratio="mixed", alpha=0.875, loss_agg=agg, kl_coef=0.1)

        def loss_fn(x, settings=settings):
            return compute_policy_loss(x, old, ref, adv, mask, anchor, index, settings, 7.0)[0]

        assert torch.autograd.gradcheck(loss_fn, (lp,), eps=1e-6, atol=1e-8)


def test_off_policy_uses_ref_on_anchor_tokens():
    lp = torch.tensor([-1.0, -1.0, -1.0], dtype=F64)
    old = torch.tensor([-1.5, -1.5, -1.5], dtype=F64)
    ref = torch.tensor([-0.5, -0.5, -0.5], dtype=F64)
    anchor = torch.tensor([False, False, True])
    log_r = OffPolicyRatio().log_ratio(lp, old, ref, anchor, 0.9)
    assert log_r.tolist() == [0.5, 0.5, -0.5]


def test_clip_ranges():
    assert StandardRatio().clip_range(0.2, 0.28, 0.8) == (0.8, 1.28)
    assert MixedRatio().clip_range(0.2, 0.28, 0.8) == (0.8, 1.28)
    lo, hi = StaticExpansionRatio().clip_range(0.2, 0.28, 0.8)
    assert lo == pytest.approx(0.75) and hi == pytest.approx(1.35)
    # static expansion keeps the standard ratio
    lp, old = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert StaticExpansionRatio().log_ratio(lp, old, lp, torch.tensor([True]), 0.8).item() == 1.0


def test_log_ratio_is_clamped():
    settings = LossSettings(ratio="mixed", alpha=0.5, log_ratio_clamp=20.0)
    lp = torch.tensor([0.0], dtype=F64)
    old = torch.tensor([-100.0], dtype=F64)
    ref = torch.tensor([-100.0], dtype=F64)
    _, metrics = compute_policy_loss(
        lp,
        old,
        ref,
        torch.ones(1, dtype=F64),
        torch.ones(1, dtype=F64),
        torch.zeros(1, dtype=torch.bool),
        torch.zeros(1, dtype=torch.long),
        settings,
        1.0,
    )
    assert metrics["loss/ratio_max"].item() == pytest.approx(math.exp(20.0))
