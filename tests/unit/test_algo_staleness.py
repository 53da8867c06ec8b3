"""Bounded staleness (``algo/staleness.py``) and the decoupled objective it trains with
(docs/algorithm.md, "Bounded staleness"): the window rule keeps the longest response within
``k`` versions, ages and their shares, version spans to per-token versions; and, by exact
enumeration over a small vocabulary, that the loss on samples drawn from a stale behaviour
policy, weighted by ``pi_prox / pi_behav`` (``algo.rollout_correction``), is the loss on
samples drawn from the proximal policy, for the standard and ARMOR's mixed ratio, anchors
included, loss and gradient. Tier: unit (pure torch)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_armor.algo.losses import LossSettings, compute_policy_loss
from megatron_armor.algo.rollout_correction import CorrectionSettings
from megatron_armor.algo.staleness import (
    spans_to_versions,
    staleness_metrics,
    token_ages,
    window_tokens,
    within_bound,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


@pytest.mark.parametrize("max_new", [1, 7, 40, 96, 8192])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_the_longest_response_spans_at_most_k_windows(max_new, k):
    w = window_tokens(max_new, k)
    assert math.ceil(max_new / w) <= k
    assert w == 1 or math.ceil(max_new / (w - 1)) > k  # the smallest such window


def test_window_tokens_refuses_nonpositive_settings():
    with pytest.raises(ValueError, match="max_staleness=0"):
        window_tokens(40, 0)


def test_ages_bound_and_shares():
    assert token_ages([3, 3, 4, 5], 5) == [2, 2, 1, 0]
    assert within_bound(3, 5, 2) and not within_bound(2, 5, 2)
    m = staleness_metrics([[3, 3, 4], [5], []], trainer_version=5, max_staleness=2)
    assert m["staleness/age_max"] == 2.0
    assert m["staleness/age_mean"] == pytest.approx((2 + 2 + 1 + 0) / 4)
    assert [m[f"staleness/age_{a}_frac"] for a in (0, 1, 2)] == [0.25, 0.25, 0.5]
    assert staleness_metrics([[], []], 5, 2) == {}


def test_spans_give_one_version_per_token():
    assert spans_to_versions([(3, 0, 2), (4, 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert spans_to_versions([(7, 0, 0)], 0) == []
    with pytest.raises(ValueError, match="cover 4 tokens, the response has 5"):
        spans_to_versions([(3, 0, 4)], 5)
    with pytest.raises(ValueError, match="not contiguous"):
        spans_to_versions([(3, 0, 2), (4, 3, 5)], 5)


# ---------------------------------------------------------------------------- decoupled loss
# One-token responses over a vocabulary of four. Probabilities are tenths, so a batch holding
# each token as many times as its tenths is an exact draw from the distribution: the loss's
# token mean over it is the expectation over the distribution.
PROXIMAL = [4, 1, 3, 2]  # the trainer's weights at the step's start (the `old` pass)
BEHAVIOUR = [1, 4, 2, 3]  # the stale engine weights that drew the tokens
REFERENCE = [2, 2, 5, 1]  # pi_ref (anchors are drawn from it, fresh: reference == engine)
ADVANTAGE = [1.0, -0.5, 0.25, -1.5]


def log_tenths(tenths: list[int]) -> torch.Tensor:
    return torch.tensor([math.log(t / 10) for t in tenths], dtype=F64)


def exact_draw(tenths: list[int], anchor: bool) -> dict:
    """The tokens of an exact draw (token ``y`` ``tenths[y]`` times) as a packed batch of
    one-token samples: ``(tokens, per-token inputs)``."""
    tokens = torch.tensor([y for y, n in enumerate(tenths) for _ in range(n)])
    n = len(tokens)
    return tokens, {
        "advantages": torch.tensor(ADVANTAGE, dtype=F64)[tokens],
        "loss_mask": torch.ones(n, dtype=F64),
        "is_anchor": torch.full((n,), anchor),
        "sample_index": torch.arange(n),
    }


def loss_and_grad(policy_draw: list[int], anchor_draw: list[int], engine_policy: list[int],
                  settings: LossSettings, theta: torch.Tensor):  # fmt: skip
    """The loss (and its gradient in ``theta``, the current policy's logits) of an exact draw
    of policy tokens from ``policy_draw`` and of anchor tokens from the reference, the engine's
    log-probs of policy tokens being ``engine_policy``'s; ``old`` is the proximal policy."""
    parts = [exact_draw(policy_draw, False), exact_draw(anchor_draw, True)]
    tokens = torch.cat([t for t, _ in parts])
    data = {k: torch.cat([d[k] for _, d in parts]) for k in parts[0][1]}
    data["sample_index"] = torch.arange(len(tokens))
    theta = theta.detach().requires_grad_(True)
    lp = torch.log_softmax(theta, -1)[tokens]
    old, ref = log_tenths(PROXIMAL)[tokens], log_tenths(REFERENCE)[tokens]
    engine = torch.where(data["is_anchor"], ref, log_tenths(engine_policy)[tokens])
    loss, _ = compute_policy_loss(lp, old, ref, settings=settings, normalizer=len(tokens),
                                  engine_logprobs=engine, **data)  # fmt: skip
    loss.backward()
    return loss.detach(), theta.grad


@pytest.mark.parametrize("ratio", ["standard", "mixed"])
def test_weighted_stale_samples_give_the_proximal_loss_and_gradient(ratio):
    """``w = pi_prox / pi_behav`` turns the expectation over stale samples into the one over
    proximal samples (cap above every weight: no truncation), for every term of the clipped
    objective: so the clip acts around the proximal policy, and anchors keep their own
    correction (reference engine == reference: weight 1)."""
    theta = torch.log(torch.tensor([0.5, 0.1, 0.2, 0.2], dtype=F64)) + 0.05
    tis = CorrectionSettings(mode="token_tis", cap=10.0)
    settings = LossSettings(ratio=ratio, alpha=7 / 8, rollout_correction=tis)
    fresh = dataclasses.replace(settings, rollout_correction=CorrectionSettings())
    stale_loss, stale_grad = loss_and_grad(BEHAVIOUR, REFERENCE, BEHAVIOUR, settings, theta)
    fresh_loss, fresh_grad = loss_and_grad(PROXIMAL, REFERENCE, PROXIMAL, fresh, theta)
    # the stale batch and the fresh one have the same token counts (10 + 10), so the token
    # means are the expectations over each distribution
    assert torch.allclose(stale_loss, fresh_loss, atol=1e-12)
    assert torch.allclose(stale_grad, fresh_grad, atol=1e-12)


def test_without_the_weight_the_stale_samples_give_another_gradient():
    """What the weight corrects: the same stale batch without it gives the behaviour
    policy's expectation, not the proximal one."""
    theta = torch.log(torch.tensor([0.5, 0.1, 0.2, 0.2], dtype=F64))
    plain = LossSettings(ratio="mixed", alpha=7 / 8)
    _, stale_grad = loss_and_grad(BEHAVIOUR, REFERENCE, BEHAVIOUR, plain, theta)
    _, fresh_grad = loss_and_grad(PROXIMAL, REFERENCE, PROXIMAL, plain, theta)
    assert (stale_grad - fresh_grad).abs().max() > 0.05


def test_truncation_bounds_the_weight_of_the_stalest_tokens():
    """``token_tis`` with cap 2: token 0 (``pi_prox / pi_behav = 4``) counts twice, not four
    times; the others as drawn."""
    theta = torch.log(torch.tensor([0.4, 0.1, 0.3, 0.2], dtype=F64))
    tis = LossSettings(ratio="standard", rollout_correction=CorrectionSettings("token_tis", 2.0))
    tokens, data = exact_draw(BEHAVIOUR, False)
    lp = torch.log_softmax(theta, -1)[tokens]
    _, sums = compute_policy_loss(lp, log_tenths(PROXIMAL)[tokens], lp.detach(),
                                  settings=tis, normalizer=len(tokens),
                                  engine_logprobs=log_tenths(BEHAVIOUR)[tokens], **data)  # fmt: skip
    weights = {0: 2.0, 1: 0.25, 2: 1.5, 3: 2 / 3}
    expected = sum(weights[int(y)] for y in tokens)
    assert float(sums["correction/policy_weight_mean"]) == pytest.approx(expected)
    assert float(sums["correction/policy_cut_frac"]) == BEHAVIOUR[0]  # token 0's draws
