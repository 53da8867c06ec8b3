"""Entropy of the token distribution from logits or full-vocabulary log-probs.

The trainer computes entropy vocab-parallel over tensor-parallel shards; these helpers are
the single-device reference (and the CPU path): shapes ``[..., V] -> [...]``.
"""

from __future__ import annotations

import torch


def entropy_from_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """``H = -sum_v p_v log p_v`` over the last axis; ``p_v = 0`` terms contribute 0."""
    probs = logprobs.exp()
    terms = torch.where(probs > 0, probs * logprobs, torch.zeros_like(logprobs))
    return -terms.sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - sum_v softmax(z)_v z_v`` over the last axis (stable for large ``z``)."""
    if logits.element_size() < 4:  # bf16/fp16: the softmax sum needs fp32 accumulation
        logits = logits.float()
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def sampled_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """``-log p(y_t)`` per token ``[T]``: an unbiased one-sample estimate of ``H`` for ``y ~ p``.

    Useful where only the sampled token's log-prob is available (e.g. engine log-probs).
    """
    return -logprobs
