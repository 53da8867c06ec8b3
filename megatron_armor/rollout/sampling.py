"""Next-token sampling and per-token log-probs shared by the embedded engine and its tests.

Log-prob convention (matches the trainer, docs/algorithm.md, mixed optimization): the recorded log-prob of a sampled
token ``y`` is ``log_softmax(logits / T)[y]``, i.e. of the temperature-scaled distribution
*before* top-k / top-p truncation. Truncation only changes which tokens can be drawn; the
trainer recomputes ``log_softmax(logits / T)`` over the full vocabulary, so recording the
truncated (renormalized) probability would make engine and trainer disagree whenever
truncation is on. ``temperature == 0`` means greedy decoding, and its log-probs are then
``log_softmax(logits)`` (``T = 1``).
"""

from __future__ import annotations

import torch

from megatron_armor.rollout.protocol import SamplingParams


def effective_temperature(temperature: float) -> float:
    """The ``T`` in ``log_softmax(logits / T)``: the sampling temperature, or 1 for greedy."""
    return temperature if temperature > 0 else 1.0


def scaled_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32 over the last dim; ``[..., V] -> [..., V]``."""
    return torch.log_softmax(logits.float() / effective_temperature(temperature), dim=-1)


def truncate_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask to ``-inf`` every token outside the top-k and outside the top-p nucleus.

    ``scaled`` is ``[B, V]`` (temperature already applied). Top-p keeps the smallest set of
    most-probable tokens whose probability mass reaches ``top_p`` (always at least one).
    """
    out = scaled
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits`` ``[B, V]``.

    Returns ``(tokens [B] int64, logprobs [B] fp32)`` where ``logprobs`` follow the module
    convention (temperature-scaled, before truncation).
    """
    logp = scaled_log_probs(logits, params.temperature)
    if params.temperature <= 0:
        tokens = torch.argmax(logp, dim=-1)
    else:
        kept = truncate_logits(logp, params.top_k, params.top_p)
        tokens = exponential_race(kept, generator)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def exponential_race(log_weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Sample ``i ~ softmax(log_weights)`` per row as ``argmax_i(log_weights_i - log E_i)``,
    ``E_i ~ Exp(1)`` i.i.d. (the Gumbel-max trick; ``-log E`` is Gumbel). Exact, and much
    cheaper than ``torch.multinomial`` on CPU. ``[B, V] -> [B]``."""
    noise = torch.empty_like(log_weights).exponential_(1.0, generator=generator)
    return torch.argmax(log_weights - noise.log(), dim=-1)
