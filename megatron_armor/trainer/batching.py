"""From a packed :class:`TrainBatch` to this rank's micro-batches.

1. Data-parallel shard: samples are assigned to DP ranks balanced by tokens (longest first,
   each to the rank with the fewest tokens so far; deterministic, so every rank computes the
   same assignment from the same full batch). Each shard keeps the batch order.
2. Buckets: the shard's samples sorted by length (ties by sample id; deterministic), so a
   micro-batch holds samples of similar length and little padding.
3. Micro-batches: consecutive samples of that order, as many as fit ``micro_batch_tokens``
   tokens — *padded* tokens (``rows * longest row``) in the padded layout, real tokens in the
   packed one; a longer sample forms its own micro-batch.
4. Layout, padded (every attention implementation; the CPU path): a right-padded ``[n, L]``
   batch (one sample per row, positions from 0), so causal attention is exactly per-sample
   attention and RoPE positions restart per sample. Packed (``thd``, Transformer Engine):
   one ``[1, T]`` row of the samples back to back with ``cu_seqlens`` (megatron-core's
   ``PackedSeqParams``), positions restarting per sample, no padding but the few tokens that
   round ``T`` up to ``pad_multiple`` (a segment of their own). Per-token training data stays
   packed ``[T]`` (only real tokens, in order) with ``token_index`` pointing back into the
   full batch: every entry of the batch's ``token_data`` is sliced alike, whatever its name.

The loss does not depend on the micro-batching: its normalizer is global (``schedule.py``)
and every per-sample quantity stays within one micro-batch. Fillers (stand-in micro-batches
that weigh nothing) keep the collective schedule of a rank without samples, or of a MoE whose
expert groups span DP ranks, in step (:func:`plan_micro_batches`).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch

from megatron_armor.types import PerTokenData, TrainBatch


@dataclass
class MicroBatch(PerTokenData):
    """One micro-batch: model inputs ``[n, L]`` and packed per-token data ``[T]``."""

    tokens: torch.Tensor
    """``[n, L]`` int64 token ids, right-padded with 0."""
    position_ids: torch.Tensor
    """``[n, L]`` int64 positions 0..len-1 per row."""
    valid: torch.Tensor
    """``[n, L]`` bool, real (non-pad) tokens."""
    token_data: dict[str, torch.Tensor]
    """The batch's per-token loss inputs ``[T]`` (``TrainBatch.token_data``), this micro-batch's
    tokens only; floating ones as float32."""
    sample_index: torch.Tensor
    """``[T]`` int64, 0-based row of each packed token."""
    token_index: torch.Tensor
    """``[T]`` int64, position of each packed token in the full batch."""
    cu_seqlens: torch.Tensor | None = None
    """Packed layout only: ``[n + 1]`` int32 segment boundaries in the ``[1, T]`` row (a last
    segment of padding when ``T`` was rounded up); ``None`` for the padded layout."""
    samples: tuple[int, ...] = ()
    """The batch's sample ids in this micro-batch, in row (segment) order."""
    filler: bool = False
    """A stand-in (:func:`filler_micro_batch`): run for the collectives, reports nothing."""

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def max_seqlen(self) -> int:
        """The longest segment (packed) or row (padded)."""
        if self.cu_seqlens is None:
            return self.seq_len
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def sample_starts(self) -> torch.Tensor:
        """``[n, L]`` bool: the first position of each sample (its log-prob is defined as 0)."""
        starts = torch.zeros_like(self.valid)
        if self.cu_seqlens is None:
            starts[:, 0] = True
        else:
            starts[0, self.cu_seqlens[:-1].long()] = True
        return starts

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])


FP8_ROWS = 16
"""Rows an FP8 GEMM input needs a multiple of: Transformer Engine asserts the product of all
dimensions but the last divisible by 8 (``assert_dim_for_fp8_exec``); 16 keeps the packed
sequence's own alignment."""


def token_multiple(tp: int, sequence_parallel: bool, fp8: bool) -> int:
    """What a micro-batch's token count is padded to a multiple of. Sequence parallelism
    splits the tokens over the ``tp`` ranks; with FP8 each rank's *local* shard (``T / tp``
    rows) feeds an FP8 GEMM, so ``T`` is padded to ``tp * 16`` (``lcm(tp, 16)`` would leave
    ``T / tp`` at 4 rows' granularity for ``tp = 4``, which TE refuses)."""
    return (tp if sequence_parallel else 1) * (FP8_ROWS if fp8 else 1)


def shard_samples(lengths: list[int], dp_size: int) -> list[list[int]]:
    """Assign sample ids to ``dp_size`` ranks balanced by tokens (LPT greedy); sorted ids."""
    heap = [(0, rank) for rank in range(dp_size)]
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, rank = heapq.heappop(heap)
        shards[rank].append(i)
        heapq.heappush(heap, (load + lengths[i], rank))
    return [sorted(s) for s in shards]


def bucket_by_length(ids: list[int], lengths: list[int]) -> list[int]:
    """``ids`` sorted by ``(length, id)``: neighbours have similar lengths (deterministic)."""
    return sorted(ids, key=lambda i: (lengths[i], i))


def split_micro_batches(
    ids: list[int], lengths: list[int], budget: int, packed: bool = False
) -> list[list[int]]:
    """Consecutive groups of ``ids`` costing at most ``budget`` tokens (or one sample each):
    ``len(group) * max(length)`` padded, ``sum(length)`` packed (``budget`` >= 1: the
    trainer section's check, ``config/fields.py``)."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = longest = 0
    for i in ids:
        new_total, new_longest = total + lengths[i], max(longest, lengths[i])
        cost = new_total if packed else (len(current) + 1) * new_longest
        if current and cost > budget:
            groups.append(current)
            current, new_total, new_longest = [], lengths[i], lengths[i]
        current.append(i)
        total, longest = new_total, new_longest
    if current:
        groups.append(current)
    return groups


def _token_data(batch: TrainBatch, ids: list[int], lengths: list[int]) -> dict:
    """The packed ``[T]`` per-token data of samples ``ids`` (in that order): every entry of
    ``batch.token_data`` (floating ones as float32), the rows and the batch positions."""
    bounds = batch.cu_seqlens.tolist()
    index = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in ids])
    data = {key: value[index] for key, value in batch.token_data.items()}
    return {
        "token_data": {k: v.float() if v.is_floating_point() else v for k, v in data.items()},
        "sample_index": torch.repeat_interleave(torch.arange(len(ids)), torch.tensor(lengths)),
        "token_index": index,
    }


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
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(seq).unsqueeze(0).expand(len(ids), seq).contiguous(),
        valid=valid,
        samples=tuple(ids),
        **_token_data(batch, ids, lengths),
    )


def build_packed_micro_batch(
    batch: TrainBatch, ids: list[int], pad_multiple: int = 1
) -> MicroBatch:
    """The packed ``[1, T]`` (``thd``) layout of samples ``ids``: ``cu_seqlens`` over the
    samples, plus one padding segment when ``T`` is rounded up to ``pad_multiple``."""
    bounds = batch.cu_seqlens.tolist()
    lengths = [bounds[i + 1] - bounds[i] for i in ids]
    real = sum(lengths)
    total = -(-real // pad_multiple) * pad_multiple
    segments = lengths + ([total - real] if total > real else [])
    tokens = torch.zeros(1, total, dtype=torch.long)
    tokens[0, :real] = torch.cat([batch.tokens[bounds[i] : bounds[i + 1]] for i in ids])
    valid = torch.zeros(1, total, dtype=torch.bool)
    valid[0, :real] = True
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.cat([torch.arange(n) for n in segments]).unsqueeze(0),
        valid=valid,
        cu_seqlens=torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.int32),
        samples=tuple(ids),
        **_token_data(batch, ids, lengths),
    )


def with_samples(batch: TrainBatch, mb: MicroBatch, ids: list[int], pad_multiple: int = 1):
    """``mb``'s layout (padded or packed) rebuilt with samples ``ids`` of ``batch`` only."""
    build = build_packed_micro_batch if mb.packed else build_micro_batch
    return build(batch, ids, pad_multiple)


def padding_counts(micro_batches: list[MicroBatch]) -> tuple[int, int]:
    """``(real tokens, computed positions)`` of ``micro_batches`` (padding = the difference;
    fillers are no training data and count in neither)."""
    real_mbs = [mb for mb in micro_batches if not mb.filler]
    real = sum(int(mb.valid.sum()) for mb in real_mbs)
    return real, sum(mb.num_rows * mb.seq_len for mb in real_mbs)


def filler_micro_batch(batch: TrainBatch, packed: bool, pad_multiple: int = 1) -> MicroBatch:
    """A stand-in micro-batch: sample 0 with its loss mask and anchor flags zeroed, so it adds
    nothing to the loss, the gradients or the counts, and ``filler`` set, so it reports no
    log-prob (``schedule.py``) and no padding. It runs where a rank must take part in a
    collective schedule it has no data for (:func:`plan_micro_batches`)."""
    build = build_packed_micro_batch if packed else build_micro_batch
    mb = build(batch, [0], pad_multiple)
    mb.loss_mask = torch.zeros_like(mb.loss_mask)
    mb.is_anchor = torch.zeros_like(mb.is_anchor)
    mb.filler = True
    return mb


def plan_micro_batches(
    batch: TrainBatch,
    dp_rank: int,
    dp_size: int,
    micro_batch_tokens: int,
    pad_multiple: int = 1,
    packed: bool = False,
    bucket: bool = True,
    equal_counts: bool = False,
) -> list[MicroBatch]:
    """This DP rank's micro-batches of ``batch``: bucketed by length (``bucket``; off only to
    compare with batch order), padded ``[n, L]`` or ``packed`` ``[1, T]``.

    A rank that receives no sample (fewer samples than DP ranks) gets one filler micro-batch
    (:func:`filler_micro_batch`), so the collective schedule still runs. With
    ``equal_counts`` every rank is padded with fillers up to the most micro-batches of any DP
    rank: the expert layers' all-to-alls pair the micro-batches of different DP ranks when
    the expert-parallel group spans them (``config/moe.py``: :func:`expert_groups_span_dp`),
    and a micro-batch without a partner would hang. Every rank knows every length, so the
    count needs no communication.
    """
    build = build_packed_micro_batch if packed else build_micro_batch
    lengths = batch.seq_lengths()
    if not lengths:
        raise ValueError("empty TrainBatch: no samples to train on")
    groups = micro_batch_ids(lengths, dp_rank, dp_size, micro_batch_tokens, packed, bucket)
    mbs = [build(batch, g, pad_multiple) for g in groups]
    target = 1
    if equal_counts:
        target = max(micro_batch_counts(lengths, dp_size, micro_batch_tokens, packed, bucket))
    fillers = max(target - len(mbs), 0)
    return mbs + [filler_micro_batch(batch, packed, pad_multiple) for _ in range(fillers)]


def micro_batch_counts(
    lengths: list[int], dp_size: int, budget: int, packed: bool = False, bucket: bool = True
) -> list[int]:
    """Micro-batches of each DP rank (at least 1: a rank without samples runs a filler)."""
    return [
        max(1, len(micro_batch_ids(lengths, rank, dp_size, budget, packed, bucket)))
        for rank in range(dp_size)
    ]


def holding_counts(
    batch: TrainBatch,
    selected: torch.Tensor,
    dp_size: int,
    budget: int,
    packed: bool = False,
    bucket: bool = True,
) -> list[int]:
    """Per DP rank: its micro-batches holding a token of ``selected`` (``[total]`` bool over
    ``batch``), at least 1 — the micro-batch count of a pass over those micro-batches only
    (the exact-KL diagnostic's reference pass, ``megatron_trainer.py``)."""
    bounds = batch.cu_seqlens.tolist()
    holds = [bool(selected[bounds[i] : bounds[i + 1]].any()) for i in range(batch.num_samples)]
    lengths = batch.seq_lengths()
    counts = []
    for rank in range(dp_size):
        groups = micro_batch_ids(lengths, rank, dp_size, budget, packed, bucket)
        counts.append(max(1, sum(any(holds[i] for i in g) for g in groups)))
    return counts


def micro_batch_ids(
    lengths: list[int],
    dp_rank: int,
    dp_size: int,
    budget: int,
    packed: bool = False,
    bucket: bool = True,
) -> list[list[int]]:
    """The sample ids of this DP rank's micro-batches (``[]`` when the rank gets none)."""
    ids = shard_samples(lengths, dp_size)[dp_rank]
    order = bucket_by_length(ids, lengths) if bucket else ids
    return split_micro_batches(order, lengths, budget, packed) if ids else []


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
