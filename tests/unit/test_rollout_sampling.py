"""Sampling primitives of the embedded engine (unit tier)."""

from __future__ import annotations

import pytest
import torch

from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sampling import exponential_race, sample_next_tokens, truncate_logits

pytestmark = pytest.mark.unit


def test_exponential_race_matches_the_softmax_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    gen = torch.Generator().manual_seed(0)
    draws = exponential_race(probs.log().expand(40000, 4), gen)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, probs, atol=0.01)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert torch.isfinite(truncate_logits(logits, 2, 1.0)).tolist() == [
        [True, True, False, False, False]
    ]
    probs = torch.softmax(logits, -1)[0]  # [0.64, 0.23, 0.09, 0.03, 0.01]
    keep = torch.isfinite(truncate_logits(logits, -1, float(probs[0] + probs[1]) - 1e-3))
    assert keep.tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(truncate_logits(logits, -1, 0.01)).sum() == 1  # always >= 1 token


def test_logprobs_are_of_the_tempered_distribution_before_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    params = SamplingParams(temperature=0.5, top_k=1, seed=0)
    tokens, logps = sample_next_tokens(logits, params, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [0]  # top-k 1 keeps only the argmax
    expected = torch.log_softmax(logits / 0.5, -1)[0, 0]
    assert torch.allclose(logps[0], expected) and logps[0] < 0  # not the truncated log(1) = 0
    greedy_tokens, greedy_logps = sample_next_tokens(logits, SamplingParams(temperature=0.0), None)
    assert greedy_tokens.tolist() == [0]
    assert torch.allclose(greedy_logps[0], torch.log_softmax(logits, -1)[0, 0])
