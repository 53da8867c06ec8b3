"""Loss aggregation over a packed mini-batch (docs/algorithm.md, mixed optimization), one class per ``algo.loss_agg``.

A mini-batch is split into micro-batches and data-parallel shards, always at sample
boundaries. Each aggregation returns the *local* sum of its units divided by an explicit
``normalizer``: the global number of units over the whole mini-batch. Summing the returned
values over micro-batches and DP ranks therefore gives the mini-batch mean exactly.

Shapes: ``per_token`` / ``loss_mask`` ``[T]`` float, ``sample_index`` ``[T]`` int64 (the
sample each packed token belongs to, 0-based within the micro-batch).
"""

from __future__ import annotations

import torch


def per_sample_sums(values: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """``s_i = sum_{t in sample i} values_t``; ``[T] -> [N]`` with ``N = max(sample_index) + 1``."""
    n = int(sample_index.max().item()) + 1 if sample_index.numel() else 0
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    return out.index_add(0, sample_index, values)


class TokenMean:
    """``token-mean``: ``L = sum_t m_t l_t / N_tok`` (DAPO); unit = one masked token."""

    name = "token-mean"

    def units(self, loss_mask: torch.Tensor, sample_index: torch.Tensor) -> int:
        """Local number of aggregation units (sum it over micro-batches and ranks)."""
        return int(loss_mask.sum().item())

    def reduce(
        self,
        per_token: torch.Tensor,
        loss_mask: torch.Tensor,
        sample_index: torch.Tensor,
        normalizer: float,
    ) -> torch.Tensor:
        """Local sum of units divided by the global ``normalizer``; a 0-dim tensor."""
        return (per_token * loss_mask).sum() / normalizer


class SeqMeanTokenSum(TokenMean):
    """``seq-mean-token-sum``: ``L = sum_i (sum_{t in i} m_t l_t) / N_seq``; unit = one sample with >= 1 masked token."""

    name = "seq-mean-token-sum"

    def units(self, loss_mask, sample_index):
        return int((per_sample_sums(loss_mask, sample_index) > 0).sum().item())

    def sequence_values(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Per-sample value from token sums ``[N]`` and masked-token counts ``[N]``."""
        return sums

    def reduce(self, per_token, loss_mask, sample_index, normalizer):
        sums = per_sample_sums(per_token * loss_mask, sample_index)
        counts = per_sample_sums(loss_mask, sample_index)
        return self.sequence_values(sums, counts).sum() / normalizer


class SeqMeanTokenMean(SeqMeanTokenSum):
    """``seq-mean-token-mean`` (GRPO): ``L = sum_i mean_{t in i}(l_t) / N_seq``."""

    name = "seq-mean-token-mean"

    def sequence_values(self, sums, counts):
        return sums / counts.clamp(min=1.0)
