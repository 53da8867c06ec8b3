"""The exact vocabulary-wide KL diagnostic (docs/metrics.md): the gathered reference in
``algo.kl``, the vocab-parallel version in ``trainer.logprobs`` (TP=1 here; TP=2 in
``tests/dist/test_trainer_dist.py``), and the driver's choice of samples and positions."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_armor.algo.kl import exact_kl
from megatron_armor.orchestration.step.step_metrics import exact_kl_batch
from megatron_armor.trainer.logprobs import vocab_parallel_exact_kl
from megatron_armor.types import Group, Sample, SampleSource, pack_groups

pytestmark = pytest.mark.unit


def test_exact_kl_of_two_point_distributions_by_hand():
    p, q = torch.tensor([[0.25, 0.75]]), torch.tensor([[0.5, 0.5]])
    kl_pq, kl_qp = exact_kl(p.log(), q.log())
    assert kl_pq.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    assert kl_qp.item() == pytest.approx(0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75))
    kl, reverse = exact_kl(torch.randn(3, 9), torch.randn(3, 9))
    assert (kl >= 0).all() and (reverse >= 0).all()
    zero_pq, zero_qp = exact_kl(p.log(), p.log() + 5.0)  # a shift is the same distribution
    assert zero_pq.abs().max() < 1e-12 and zero_qp.abs().max() < 1e-12


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_kl_matches_the_gathered_one_and_skips_padding(temperature):
    g = torch.Generator().manual_seed(0)
    vocab, padded = 37, 40
    zp, zq = torch.randn(6, padded, generator=g) * 3, torch.randn(6, padded, generator=g) * 3
    zq[:, vocab:] = 1e4  # padded columns must not count, whatever they hold
    kl_pq, kl_qp = vocab_parallel_exact_kl(zp, zq, vocab, temperature)
    ref_pq, ref_qp = exact_kl(zp[:, :vocab], zq[:, :vocab], temperature)
    torch.testing.assert_close(kl_pq.double(), ref_pq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl_qp.double(), ref_qp, atol=1e-5, rtol=1e-5)
    same_pq, same_qp = vocab_parallel_exact_kl(zp, zp.clone(), vocab, temperature)
    assert same_pq.abs().max() < 1e-6 and same_qp.abs().max() < 1e-6


def _sample(qid: str, response: int, source=SampleSource.POLICY) -> Sample:
    return Sample(query_id=qid, prompt_ids=[1, 2, 3], response_ids=list(range(4, 4 + response)),
                  response_logprobs=[-0.1] * response, source=source)  # fmt: skip


def _group(qid: str, samples: list[Sample], anchor_index: int | None) -> Group:
    return Group(qid, samples, anchor_index, advantages=[0.5] * len(samples))


def test_diagnostic_batch_takes_on_policy_samples_and_spaced_positions():
    groups = [
        _group(
            f"q{g}",
            [_sample(f"q{g}", 10 + g) for _ in range(3)]
            + [_sample(f"q{g}", 7, SampleSource.REFERENCE)],
            3,
        )  # fmt: skip
        for g in range(2)
    ]
    batch = pack_groups(groups)
    small = exact_kl_batch(batch, samples=3, positions=4)
    assert small.num_samples == 3 and not small.is_anchor.any()
    cu = small.cu_seqlens.tolist()
    for i in range(3):
        chosen = (small.loss_mask[cu[i] : cu[i + 1]] > 0).nonzero().squeeze(1).tolist()
        assert len(chosen) == 4 and all(c >= 3 for c in chosen)  # response tokens only
        assert chosen == sorted(set(chosen))
    everything = exact_kl_batch(batch, samples=100, positions=100)
    assert everything.num_samples == 6  # the two anchors are left out
    assert everything.loss_mask.sum() == sum(10 + g for g in range(2) for _ in range(3))
    only_anchor = pack_groups([_group("a", [_sample("a", 5, SampleSource.REFERENCE)], 0)])
    assert exact_kl_batch(only_anchor, 4, 4) is None
