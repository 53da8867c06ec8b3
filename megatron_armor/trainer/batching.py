"""From a packed :class:`TrainBatch` to this rank's micro-batches.

1. Data-parallel shard: samples are assigned to DP ranks balanced by tokens (longest first,
   each to the rank with the fewest tokens so far; deterministic, so every rank computes the
   same assignment from the same full batch). Each shard keeps the batch order.
2. Micro-batches: consecutive samples of the shard, as many as fit ``micro_batch_tokens``
   *padded* tokens (``rows * longest row``); a longer sample forms its own micro-batch.
3. Layout: each micro-batch is a right-padded ``[n, L]`` batch (one sample per row, positions
   from 0), so causal attention is exactly per-sample attention and RoPE positions restart per
   sample, with every megatron-core attention implementation (the local spec does not take
   packed sequences). Per-token training data stays packed ``[T]`` (only real tokens, in row
   order) with ``token_index`` pointing back into the full batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from megatron_armor.types import TrainBatch


@dataclass
class MicroBatch:
    """One micro-batch: model inputs ``[n, L]`` and packed per-token data ``[T]``."""

    tokens: torch.Tensor
    """``[n, L]`` int64 token ids, right-padded with 0."""
    position_ids: torch.Tensor
    """``[n, L]`` int64 positions 0..len-1 per row."""
    valid: torch.Tensor
    """``[n, L]`` bool, real (non-pad) tokens."""
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    is_anchor: torch.Tensor
    sample_index: torch.Tensor
    """``[T]`` int64, 0-based row of each packed token."""
    token_index: torch.Tensor
    """``[T]`` int64, position of each packed token in the full batch."""

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])


def shard_samples(lengths: list[int], dp_size: int) -> list[list[int]]:
    """Assign sample ids to ``dp_size`` ranks balanced by tokens (LPT greedy); sorted ids."""
    heap = [(0, rank) for rank in range(dp_size)]
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, rank = heapq.heappop(heap)
        shards[rank].append(i)
        heapq.heappush(heap, (load + lengths[i], rank))
    return [sorted(s) for s in shards]


def split_micro_batches(ids: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of ``ids`` with ``len(group) * max(length) <= budget`` (or one sample)."""
    if budget <= 0:
        raise ValueError(f"trainer.micro_batch_tokens={budget}: must be > 0")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in ids:
        new_longest = max(longest, lengths[i])
        if current and (len(current) + 1) * new_longest > budget:
            groups.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def build_micro_batch(batch: TrainBatch, ids: list[int], pad_multiple: int = 1) -> MicroBatch:
    """The ``[n, L]`` layout of samples ``ids`` of ``batch`` (``L`` rounded up to ``pad_multiple``)."""
    bounds = batch.cu_seqlens.tolist()
    lengths = [bounds[i + 1] - bounds[i] for i in ids]
    seq = -(-max(lengths) // pad_multiple) * pad_multiple
    tokens = torch.zeros(len(ids), seq, dtype=torch.long)
    valid = torch.zeros(len(ids), seq, dtype=torch.bool)
    for row, i in enumerate(ids):
        tokens[row, : lengths[row]] = batch.tokens[bounds[i] : bounds[i + 1]]
        valid[row, : lengths[row]] = True
    index = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in ids])
    lengths_t = torch.tensor(lengths)
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(seq).unsqueeze(0).expand(len(ids), seq).contiguous(),
        valid=valid,
        loss_mask=batch.loss_mask[index].float(),
        advantages=batch.advantages[index].float(),
        old_logprobs=batch.old_logprobs[index].float(),
        ref_logprobs=batch.ref_logprobs[index].float(),
        is_anchor=batch.is_anchor[index].bool(),
        sample_index=torch.repeat_interleave(torch.arange(len(ids)), lengths_t),
        token_index=index,
    )


def plan_micro_batches(
    batch: TrainBatch,
    dp_rank: int,
    dp_size: int,
    micro_batch_tokens: int,
    pad_multiple: int = 1,
) -> list[MicroBatch]:
    """This DP rank's micro-batches of ``batch``.

    A rank that receives no sample (fewer samples than DP ranks) gets one micro-batch of
    sample 0 with its loss mask zeroed, so the collective schedule still runs; it adds nothing
    to the loss, the gradients or the counts.
    """
    lengths = batch.seq_lengths()
    if not lengths:
        raise ValueError("empty TrainBatch: no samples to train on")
    ids = shard_samples(lengths, dp_size)[dp_rank]
    if not ids:
        mb = build_micro_batch(batch, [0], pad_multiple)
        mb.loss_mask = torch.zeros_like(mb.loss_mask)
        mb.is_anchor = torch.zeros_like(mb.is_anchor)
        return [mb]
    groups = split_micro_batches(ids, lengths, micro_batch_tokens)
    return [build_micro_batch(batch, g, pad_multiple) for g in groups]


def split_minibatches(batch: TrainBatch, num_minibatches: int) -> list[TrainBatch]:
    """Consecutive, near-equal (in samples) mini-batches of ``batch``."""
    n = batch.num_samples
    if not 1 <= num_minibatches <= n:
        raise ValueError(
            f"num_minibatches={num_minibatches} for a batch of {n} samples; it must be in [1, {n}] "
            f"(rollout.batch / trainer.ppo_mini_batch)"
        )
    edges = [round(k * n / num_minibatches) for k in range(num_minibatches + 1)]
    return [batch.select(list(range(edges[k], edges[k + 1]))) for k in range(num_minibatches)]
