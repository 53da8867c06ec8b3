"""Group advantages (docs/algorithm.md, advantages), and KL estimators. Tier: unit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_armor.algo.advantages import assign_advantages, compute_advantages
from megatron_armor.algo.kl import kl_k1, kl_k2, kl_k3
from megatron_armor.types import Group, Sample, SampleSource

pytestmark = pytest.mark.unit


def test_grpo_hand_values():
    # mean 0, unbiased std sqrt(4/3)
    adv = compute_advantages(torch.tensor([1.0, -1.0, -1.0, 1.0]), "grpo")
    expected = 1 / (math.sqrt(4 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)


def test_grpo_anchor_included_in_mean_and_std():
    """15 wrong on-policy samples + 1 correct anchor: the anchor carries the signal."""
    policy = [Sample("q", [1], [2], score=-1.0) for _ in range(3)]
    anchor = Sample("q", [1], [2, 3], score=1.0, source=SampleSource.REFERENCE, acc=True)
    group = Group("q", policy + [anchor], anchor_index=3)
    assign_advantages([group], "grpo")
    # mean -0.5; deviations -0.5 x3, 1.5; unbiased var (3*0.25 + 2.25)/3 = 1
    assert group.advantages == pytest.approx([-0.5, -0.5, -0.5, 1.5], rel=1e-5)


def test_qae_hand_values():
    # sorted [-1, -1, 1, 1]; k = 0.45 -> position 1.35 -> -1 + 0.35 * 2 = -0.3
    adv = compute_advantages(torch.tensor([1.0, -1.0, -1.0, 1.0]), "qae", quantile=0.45)
    std = math.sqrt(4 / 3) + 1e-6
    assert adv.tolist() == pytest.approx([1.3 / std, -0.7 / std, -0.7 / std, 1.3 / std], rel=1e-6)
    # k = 0.5 on an odd group is the median
    adv = compute_advantages(torch.tensor([0.0, 3.0, 1.0]), "qae", quantile=0.5)
    std = math.sqrt(21 / 9) + 1e-6  # deviations -4/3, 5/3, -1/3 -> unbiased var 21/9
    assert adv.tolist() == pytest.approx([-1 / std, 2 / std, 0.0], rel=1e-6)


@pytest.mark.parametrize("k", [0.0, 0.2, 0.45, 0.5, 0.9, 1.0])
def test_qae_matches_numpy_quantile(k):
    rng = np.random.default_rng(3)
    scores = rng.normal(size=16)
    adv = compute_advantages(torch.tensor(scores), "qae", quantile=k)
    expected = (scores - np.quantile(scores, k)) / (scores.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_constant_group_gives_zero_advantage():
    for method in ("grpo", "qae"):
        assert compute_advantages(torch.full((16,), -1.0), method).abs().max().item() == 0.0


def test_overlong_penalty_enters_advantages():
    adv = compute_advantages(torch.tensor([1.0, 0.5, -1.0]), "grpo")
    assert adv[0] > adv[1] > adv[2]


def test_advantage_errors_name_the_setting():
    with pytest.raises(ValueError, match="algo.advantage='gae'"):
        compute_advantages(torch.tensor([0.0, 1.0]), "gae")
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(torch.tensor([1.0]), "grpo")
    with pytest.raises(ValueError, match="qae_quantile"):
        compute_advantages(torch.tensor([0.0, 1.0]), "qae", quantile=1.5)


def test_kl_estimators_hand_values():
    logp, logq = torch.tensor([0.5]), torch.tensor([0.2])
    assert kl_k1(logp, logq).item() == pytest.approx(0.3)
    assert kl_k2(logp, logq).item() == pytest.approx(0.045)
    assert kl_k3(logp, logq).item() == pytest.approx(math.exp(-0.3) - 1 + 0.3)


def test_k1_k3_are_unbiased_in_expectation():
    """E_{y~p}[k(y)] computed exactly over a small vocabulary equals KL(p || q)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    exact = (p * (p / q).log()).sum()
    for k in (kl_k1, kl_k3):
        torch.testing.assert_close((p * k(p.log(), q.log())).sum(), exact)
    assert (kl_k3(p.log(), q.log()) >= 0).all()
