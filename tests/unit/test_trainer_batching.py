"""Unit tier: DP sharding, micro-batch planning and the ``[n, L]`` layout of packed batches."""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dist"))

from tiny_models import make_batch  # noqa: E402

from megatron_armor.algo.losses import LossSettings, compute_policy_loss, count_units  # noqa: E402
from megatron_armor.config.moe import expert_groups_span_dp  # noqa: E402
from megatron_armor.trainer.batching import (  # noqa: E402
    bucket_by_length,
    build_micro_batch,
    build_packed_micro_batch,
    holding_counts,
    micro_batch_counts,
    padding_counts,
    plan_micro_batches,
    shard_samples,
    split_micro_batches,
    split_minibatches,
)

pytestmark = pytest.mark.unit


def test_shards_are_balanced_disjoint_and_complete() -> None:
    lengths = [9, 3, 7, 7, 2, 12, 5, 1]
    shards = shard_samples(lengths, 3)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)
    assert all(s == sorted(s) for s in shards)


def test_micro_batches_respect_padded_budget() -> None:
    lengths = [4, 6, 3, 10, 2, 2]
    groups = split_micro_batches(list(range(6)), lengths, 12)
    assert [i for g in groups for i in g] == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 12


def test_layout_round_trips_the_packed_batch() -> None:
    batch = make_batch()
    mb = build_micro_batch(batch, [1, 4, 6], pad_multiple=4)
    assert mb.seq_len % 4 == 0
    assert torch.equal(mb.tokens[mb.valid], batch.tokens[mb.token_index])
    assert torch.equal(mb.loss_mask, batch.loss_mask[mb.token_index])
    assert torch.equal(mb.position_ids[mb.valid], batch.position_ids[mb.token_index])
    assert mb.sample_index.tolist() == sorted(mb.sample_index.tolist())


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("budget", [16, 40, 1000])
def test_normalizer_is_invariant_to_the_split(dp: int, budget: int) -> None:
    """Summing the local units over micro-batches and DP ranks gives the mini-batch's units."""
    batch = make_batch()
    for agg in ("token-mean", "seq-mean-token-mean"):
        total = sum(
            count_units(agg, mb.loss_mask, mb.sample_index)
            for rank in range(dp)
            for mb in plan_micro_batches(batch, rank, dp, budget)
        )
        assert total == count_units(agg, batch.loss_mask, batch.sample_index)


def test_rank_without_samples_gets_a_zero_weight_micro_batch() -> None:
    batch = make_batch().select([0])
    mbs = plan_micro_batches(batch, 1, 2, 100)
    assert len(mbs) == 1 and mbs[0].loss_mask.sum() == 0


UNEVEN = [0, 1, 2, 3, 4, 5]
"""Samples of ``make_batch`` (lengths 5, 8, 11, 14, 7, 10): 2 and 1 micro-batches on two DP
ranks at a 40-token budget."""


@pytest.mark.parametrize("packed", [False, True])
def test_equal_counts_pads_every_dp_rank_with_fillers(packed: bool) -> None:
    """With expert parallelism across DP ranks every rank runs as many micro-batches (the
    all-to-alls pair them): the shorter ranks get fillers that weigh nothing; the real
    micro-batches, the units and the padding are those of the plan without fillers."""
    batch = make_batch().select(UNEVEN)
    budget = 27 if packed else 40
    plain = [plan_micro_batches(batch, r, 2, budget, packed=packed) for r in range(2)]
    assert sorted(len(p) for p in plain) == [1, 2]  # the uneven split of the dense plan
    assert micro_batch_counts(batch.seq_lengths(), 2, budget, packed) == [len(p) for p in plain]
    equal = [plan_micro_batches(batch, r, 2, budget, packed=packed, equal_counts=True)
             for r in range(2)]  # fmt: skip
    assert [len(e) for e in equal] == [2, 2]
    for p, e in zip(plain, equal, strict=True):
        assert [mb.samples for mb in e[: len(p)]] == [mb.samples for mb in p]
        assert not any(mb.filler for mb in p)
        for filler in e[len(p) :]:
            assert filler.filler and filler.samples == (0,) and filler.packed == packed
            assert filler.loss_mask.sum() == 0 and filler.is_anchor.sum() == 0
        assert padding_counts(e) == padding_counts(p)
        for agg in ("token-mean", "seq-mean-token-mean"):
            units = [count_units(agg, mb.loss_mask, mb.sample_index) for mb in e]
            assert sum(units) == sum(count_units(agg, mb.loss_mask, mb.sample_index) for mb in p)


def test_filler_adds_nothing_to_the_loss() -> None:
    """Loss, gradient and every metric sum of a filler are zero (ARMOR's mixed ratio)."""
    batch = make_batch().select(UNEVEN)
    filler = plan_micro_batches(batch, 1, 2, 40, equal_counts=True)[-1]
    assert filler.filler
    logp = torch.randn(len(filler.loss_mask), requires_grad=True)
    settings = LossSettings(ratio="mixed", alpha=0.75)
    data = {
        k: filler.token_data.get(k, torch.zeros_like(logp))
        for k in ("old_logprobs", "ref_logprobs", "advantages")
    }
    loss, metrics = compute_policy_loss(
        logp, **data, loss_mask=filler.loss_mask, is_anchor=filler.is_anchor,
        sample_index=filler.sample_index, settings=settings, normalizer=10.0,
        entropy=torch.rand(len(logp)),
    )  # fmt: skip
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(logp.grad) == 0
    assert all(float(v) == 0.0 for k, v in metrics.items() if not k.endswith("_max")), metrics


def test_equal_counts_is_a_no_op_when_the_ranks_agree() -> None:
    batch = make_batch()
    for rank in range(2):
        plain = plan_micro_batches(batch, rank, 2, 40)
        equal = plan_micro_batches(batch, rank, 2, 40, equal_counts=True)
        assert [mb.samples for mb in equal] == [mb.samples for mb in plain]
        assert not any(mb.filler for mb in equal)


def test_holding_counts_count_the_micro_batches_with_selected_tokens() -> None:
    """Per DP rank, the micro-batches the diagnostic's reference pass runs (at least one)."""
    batch = make_batch().select(UNEVEN)
    bounds = batch.cu_seqlens.tolist()
    selected = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for i in (1, 3):  # rank 0's micro-batches {0, 1} and {3}
        selected[bounds[i] + 2] = True
    assert holding_counts(batch, selected, 2, 40) == [2, 1]
    assert holding_counts(batch, torch.zeros_like(selected), 2, 40) == [1, 1]


@pytest.mark.parametrize(
    ("tp", "cp", "ep", "etp", "spans"),
    [
        (1, 1, 1, 1, False),  # dense layout: no expert group
        (2, 1, 1, 2, False),  # expert TP = TP: the TP group
        (2, 1, 2, 1, False),  # EP over the two TP ranks of one DP rank
        (1, 1, 2, 1, True),  # EP over two DP ranks
        (1, 1, 2, 2, True),
        (2, 1, 4, 1, True),
        (1, 2, 2, 1, False),  # EP over the CP ranks of one DP rank
    ],
)
def test_expert_groups_span_dp(tp: int, cp: int, ep: int, etp: int, spans: bool) -> None:
    assert expert_groups_span_dp(tp, cp, ep, etp) is spans


def test_minibatches_partition_the_batch() -> None:
    batch = make_batch()
    parts = split_minibatches(batch, 3)
    assert sum(p.num_samples for p in parts) == batch.num_samples
    assert torch.equal(torch.cat([p.tokens for p in parts]), batch.tokens)
    with pytest.raises(ValueError, match="num_minibatches"):
        split_minibatches(batch, batch.num_samples + 1)


def test_buckets_are_sorted_by_length_and_deterministic() -> None:
    lengths = [9, 3, 7, 3, 2, 12]
    assert bucket_by_length(list(range(6)), lengths) == [4, 1, 3, 2, 0, 5]
    batch = make_batch()
    plain = plan_micro_batches(batch, 0, 1, 40, bucket=False)
    bucketed = plan_micro_batches(batch, 0, 1, 40)
    assert padding_counts(bucketed)[1] < padding_counts(plain)[1]  # fewer padded positions
    assert padding_counts(bucketed)[0] == padding_counts(plain)[0] == batch.num_tokens
    again = plan_micro_batches(batch, 0, 1, 40)
    assert [mb.token_index.tolist() for mb in again] == [mb.token_index.tolist() for mb in bucketed]


def test_packed_layout_has_no_padding_and_restarts_positions() -> None:
    batch = make_batch()
    mb = build_packed_micro_batch(batch, [1, 4, 6], pad_multiple=8)
    lengths = [batch.seq_lengths()[i] for i in (1, 4, 6)]
    real = sum(lengths)
    assert mb.num_rows == 1 and mb.seq_len == -(-real // 8) * 8
    assert mb.cu_seqlens.tolist()[:4] == [0, lengths[0], lengths[0] + lengths[1], real]
    assert torch.equal(mb.tokens[mb.valid], batch.tokens[mb.token_index])
    assert torch.equal(mb.position_ids[mb.valid], batch.position_ids[mb.token_index])
    starts = mb.sample_starts()[0].nonzero().squeeze(1).tolist()
    assert starts[:3] == mb.cu_seqlens.tolist()[:3]
    packed = plan_micro_batches(batch, 0, 1, 40, packed=True)
    assert padding_counts(packed) == (batch.num_tokens, batch.num_tokens)
    assert all(mb.num_rows * mb.seq_len <= 40 or len(mb.cu_seqlens) == 2 for mb in packed)


def test_the_per_token_mapping_is_what_the_loss_consumes() -> None:
    """``pack_groups`` names the per-token loss inputs once; each is an argument of the loss."""
    params = list(inspect.signature(compute_policy_loss).parameters)
    per_token = params[params.index("logprobs") + 1 : params.index("sample_index")]
    per_token.append("engine_logprobs")  # keyword: read only by a rollout correction
    assert sorted(make_batch().token_data) == sorted(per_token)
    assert "engine_logprobs" in params


@pytest.mark.parametrize("packed", [False, True])
def test_a_new_per_token_entry_flows_through_packing_unchanged(packed) -> None:
    batch = make_batch()
    batch.token_data["token_weight"] = torch.linspace(0.0, 1.0, batch.num_tokens)
    for mini in split_minibatches(batch, 2):
        assert "token_weight" in mini.token_data
        for mb in plan_micro_batches(mini, 0, 1, 64, packed=packed):
            assert sorted(mb.token_data) == sorted(batch.token_data)
            assert torch.equal(mb.token_weight, mini.token_weight[mb.token_index])
            assert torch.equal(mb.loss_mask, mini.loss_mask[mb.token_index])
