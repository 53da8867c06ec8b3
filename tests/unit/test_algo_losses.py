"""Dual-clip PPO loss, aggregation, global normalizer, metrics. Tier: unit (pure torch)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_armor.algo.aggregation import SeqMeanTokenMean, SeqMeanTokenSum, TokenMean
from megatron_armor.algo.losses import (
    METRIC_COUNTS,
    LossSettings,
    compute_policy_loss,
    count_units,
    dual_clip_pg_loss,
    finalize_metrics,
)
from megatron_armor.types import Group, Sample, pack_groups

pytestmark = pytest.mark.unit

F64 = torch.float64
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
RATIOS = ("standard", "mixed", "off_policy", "static_expansion")


def test_dual_clip_hand_values():
    ratio = torch.tensor([0.5, 1.0, 1.5, 0.5, 1.0, 1.5, 12.0], dtype=F64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0], dtype=F64)
    loss, flags = dual_clip_pg_loss(ratio, adv, 0.8, 1.28, 10.0)
    # A>0: max(-r, -clip(r)) = -min(r, clip(r)); A<0: max(r, clip(r)) capped at c = 10
    assert loss.tolist() == pytest.approx([-0.5, -1.0, -1.28, 0.8, 1.0, 1.5, 10.0])
    assert flags["clip_high"].tolist() == [False, False, True, False, False, False, False]
    assert flags["clip_low"].tolist() == [False, False, False, True, False, False, False]
    assert flags["dual"].tolist() == [False, False, False, False, False, False, True]


def test_dual_clip_gradients_are_cut_where_clipped():
    ratio = torch.tensor([1.5, 0.5, 12.0, 1.1], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0, -2.0], dtype=F64)
    loss, _ = dual_clip_pg_loss(ratio, adv, 0.8, 1.28, 10.0)
    loss.sum().backward()
    assert ratio.grad.tolist() == [0.0, 0.0, 0.0, 2.0]


def test_aggregation_hand_values():
    per_token = torch.tensor([2.0, 9.0, 1.0, 2.0, 6.0])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    index = torch.tensor([0, 0, 1, 1, 1])
    assert TokenMean().units(mask, index) == 4
    assert SeqMeanTokenMean().units(mask, index) == 2
    assert TokenMean().reduce(per_token, mask, index, 4).item() == pytest.approx(11 / 4)
    assert SeqMeanTokenMean().reduce(per_token, mask, index, 2).item() == pytest.approx((2 + 3) / 2)
    assert SeqMeanTokenSum().reduce(per_token, mask, index, 2).item() == pytest.approx((2 + 9) / 2)


def test_sample_without_response_tokens_is_not_a_unit():
    mask = torch.tensor([0.0, 0.0, 1.0, 1.0])
    index = torch.tensor([0, 0, 1, 1])
    assert count_units("seq-mean-token-mean", mask, index) == 1
    assert count_units("token-mean", mask, index) == 2


def test_policy_loss_hand_value_and_metrics():
    """Standard ratio, token-mean; two samples, the second an anchor token set."""
    lp = torch.log(torch.tensor([0.5, 0.3, 0.6, 0.2], dtype=F64))
    old = torch.log(torch.tensor([0.5, 0.2, 0.3, 0.4], dtype=F64))
    ref = torch.log(torch.tensor([0.4, 0.2, 0.3, 0.5], dtype=F64))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)
    mask = torch.ones(4, dtype=F64)
    anchor = torch.tensor([False, False, True, True])
    index = torch.tensor([0, 0, 1, 1])
    settings = LossSettings(ratio="standard", clip_low=0.2, clip_high=0.28)
    loss, m = compute_policy_loss(lp, old, ref, adv, mask, anchor, index, settings, 8.0)
    # ratios 1, 1.5, 2, 0.5 -> losses -1, -1.28, +2, +0.8 ; sum 0.52, normalizer 8
    assert loss.item() == pytest.approx(0.52 / 8)
    assert m["loss/pg"].item() == pytest.approx(0.52)
    assert m["loss/clipfrac_high"].item() == 1 and m["loss/clipfrac_low"].item() == 1
    assert m["loss/dualclip_frac"].item() == 0
    assert m["loss/ratio_mean"].item() == pytest.approx(5.0)
    assert m["loss/ratio_max"].item() == pytest.approx(2.0)
    assert m["loss/anchor_ratio_mean"].item() == pytest.approx(2.5)
    assert (m["count/tokens"], m["count/anchor_tokens"], m["count/policy_tokens"]) == (4, 2, 2)
    # reverse k1 on policy tokens: log(.5/.4) + log(.2/.2); forward k1 on anchors: log(.3/.3) + log(.5/.4)
    assert m["kl/reverse_k1"].item() == pytest.approx(math.log(1.25))
    assert m["kl/forward_k1"].item() == pytest.approx(math.log(1.25))
    assert m["kl/reverse_k3"].item() == pytest.approx(0.8 - 1 - math.log(0.8))
    # approx_kl (policy tokens): k3 with log r = 0 and log 1.5
    assert m["loss/approx_kl"].item() == pytest.approx(1.5 - 1 - math.log(1.5))


def test_kl_penalty_only_on_policy_tokens():
    lp = torch.log(torch.tensor([0.5, 0.4, 0.1], dtype=F64))
    ref = torch.log(torch.tensor([0.25, 0.4, 0.9], dtype=F64))
    zeros = torch.zeros(3, dtype=F64)
    anchor = torch.tensor([False, False, True])
    index = torch.tensor([0, 0, 1])
    for name, expected in [
        ("k1", math.log(2)),
        ("k2", 0.5 * math.log(2) ** 2),
        ("k3", 0.5 - 1 - math.log(0.5)),
    ]:
        settings = LossSettings(ratio="standard", kl_coef=0.1, kl_estimator=name)
        loss, m = compute_policy_loss(
            lp, lp, ref, zeros, torch.ones(3, dtype=F64), anchor, index, settings, 3.0
        )
        assert loss.item() == pytest.approx(0.1 * expected / 3)
        assert m["loss/kl_penalty"].item() == pytest.approx(expected)


def test_unused_positions_may_hold_non_finite_reference_logprobs():
    lp = torch.tensor([-1.0, -0.5, -0.7], requires_grad=True)
    ref = torch.tensor([-math.inf, -0.6, -0.9])  # position 0 is a prompt token
    settings = LossSettings(ratio="standard", kl_coef=0.1)
    loss, m = compute_policy_loss(
        lp,
        lp.detach(),
        ref,
        torch.ones(3),
        torch.tensor([0.0, 1.0, 1.0]),
        torch.zeros(3, dtype=torch.bool),
        torch.zeros(3, dtype=torch.long),
        settings,
        2.0,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v.item()) for v in m.values())
    assert m["loss/clipfrac_low"].dtype == torch.float32


def test_entropy_metric_and_ref_metrics_switch():
    lp = torch.zeros(2)
    settings = LossSettings(ratio="standard", ref_metrics=False)
    _, m = compute_policy_loss(
        lp,
        lp,
        lp,
        torch.ones(2),
        torch.tensor([1.0, 0.0]),
        torch.zeros(2, dtype=torch.bool),
        torch.zeros(2, dtype=torch.long),
        settings,
        1.0,
        entropy=torch.tensor([0.7, 5.0]),
    )
    assert m["loss/entropy"].item() == pytest.approx(0.7)
    assert not any(k.startswith("kl/") for k in m)


def test_finalize_metrics():
    sums = {
        "loss/pg": 3.0,
        "count/tokens": 6.0,
        "kl/forward_k1": 0.0,
        "count/anchor_tokens": 0.0,
        "loss/ratio_max": 1.7,
        "loss/grad_norm": 0.4,
    }
    out = finalize_metrics(sums)
    assert out == {
        "loss/pg": 0.5,
        "count/tokens": 6.0,
        "count/anchor_tokens": 0.0,
        "loss/ratio_max": 1.7,
        "loss/grad_norm": 0.4,
    }
    assert set(METRIC_COUNTS.values()) <= {
        "count/tokens",
        "count/anchor_tokens",
        "count/policy_tokens",
    }


@pytest.mark.parametrize(
    "override",
    [
        "algo.clip_low=0.0",
        "algo.clip_low=1.0",
        "algo.clip_high=0.0",
        "algo.dual_clip_c=1.0",
        "algo.alpha=0.0",
        "algo.alpha=1.2",
        "algo.ratio=mix",
        "algo.loss_agg=mean",
        "algo.kl_estimator=k4",
        "algo.kl_coef=-1.0",
    ],
)
def test_bad_loss_settings_are_rejected_at_load(override):
    from megatron_armor.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


def test_normalizer_must_be_positive():
    with pytest.raises(ValueError, match="normalizer"):
        compute_policy_loss(
            *(torch.zeros(1),) * 5,
            torch.zeros(1, dtype=torch.bool),
            torch.zeros(1, dtype=torch.long),
            LossSettings(),
            0,
        )


# ---------------------------------------------------------------- global normalizer


def _random_batch(seed: int, n_groups: int = 3, group_size: int = 4):
    """Packed groups (prompt + response tokens) with an anchor per group, and random log-probs."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for q in range(n_groups):
        samples = []
        for _ in range(group_size):
            p, r = (int(x) for x in torch.randint(1, 6, (2,), generator=g))
            samples.append(Sample(query_id=f"q{q}", prompt_ids=[1] * p, response_ids=[2] * r))
        adv = torch.randn(group_size, generator=g).tolist()
        groups.append(Group(f"q{q}", samples, anchor_index=group_size - 1, advantages=adv))
    batch = pack_groups(groups)
    total = batch.num_tokens
    batch.old_logprobs = -2 * torch.rand(total, generator=g, dtype=F64)
    batch.ref_logprobs = -2 * torch.rand(total, generator=g, dtype=F64)
    lp = batch.old_logprobs + 0.4 * torch.randn(total, generator=g, dtype=F64)
    return batch, lp


def _token_index(batch, sample_ids):
    bounds = batch.cu_seqlens.tolist()
    return torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in sample_ids])


def _loss_over(batch, lp_full, sample_ids, settings, normalizer):
    sub = batch.select(sample_ids)
    lp = lp_full[_token_index(batch, sample_ids)]
    return compute_policy_loss(
        lp,
        sub.old_logprobs,
        sub.ref_logprobs,
        sub.advantages.to(F64),
        sub.loss_mask.to(F64),
        sub.is_anchor,
        sub.sample_index,
        settings,
        normalizer,
    )


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_micro_batches_and_dp_shards_sum_to_full_loss(agg, ratio):
    batch, lp0 = _random_batch(seed=11)
    settings = LossSettings(ratio=ratio, alpha=0.875, loss_agg=agg, kl_coef=0.05)
    n = batch.num_samples
    normalizer = count_units(agg, batch.loss_mask, batch.sample_index)

    lp_full = lp0.clone().requires_grad_(True)
    full_loss, full_metrics = _loss_over(batch, lp_full, list(range(n)), settings, normalizer)
    full_loss.backward()

    # 2 DP ranks x uneven micro-batches; units counted locally then summed ("all-reduce")
    shards = [list(range(0, 7)), list(range(7, n))]
    micro = [[s[:3], s[3:5], s[5:]] for s in shards]
    parts = [mb for rank in micro for mb in rank if mb]
    units = sum(
        count_units(agg, batch.select(mb).loss_mask, batch.select(mb).sample_index) for mb in parts
    )
    assert units == normalizer

    lp_split = lp0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    sums: dict[str, float] = {}
    for mb in parts:
        loss, metrics = _loss_over(batch, lp_split, mb, settings, units)
        total = total + loss
        for k, v in metrics.items():
            sums[k] = (
                max(sums.get(k, -math.inf), float(v))
                if k.endswith("_max")
                else sums.get(k, 0.0) + float(v)
            )
    total.backward()
    torch.testing.assert_close(total, full_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp_split.grad, lp_full.grad, rtol=1e-12, atol=1e-12)
    full = finalize_metrics({k: float(v) for k, v in full_metrics.items()})
    split = finalize_metrics(sums)
    assert full.keys() == split.keys()
    for k in full:
        assert split[k] == pytest.approx(full[k], rel=1e-9, abs=1e-12), k


# ---------------------------------------------------------------- invariants (hypothesis)


@st.composite
def _samples(draw):
    n = draw(st.integers(2, 5))
    lengths = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    floats = st.floats(-3.0, 0.0, allow_nan=False)
    data = []
    for length in lengths:
        lp = draw(st.lists(floats, min_size=length, max_size=length))
        old = draw(st.lists(floats, min_size=length, max_size=length))
        ref = draw(st.lists(floats, min_size=length, max_size=length))
        adv = draw(st.floats(-2.0, 2.0, allow_nan=False))
        data.append((lp, old, ref, adv, draw(st.booleans())))
    return data


def _pack(data, order):
    cols = [[], [], [], [], [], []]
    for pos, i in enumerate(order):
        lp, old, ref, adv, anchor = data[i]
        for t in range(len(lp)):
            for col, v in zip(cols, (lp[t], old[t], ref[t], adv, anchor, pos), strict=True):
                col.append(v)
    lp, old, ref, adv = (torch.tensor(c, dtype=F64) for c in cols[:4])
    return lp, old, ref, adv, torch.ones_like(lp), torch.tensor(cols[4]), torch.tensor(cols[5])


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    data=_samples(),
    agg=st.sampled_from(AGGS),
    ratio=st.sampled_from(RATIOS),
    seed=st.integers(0, 99),
)
def test_loss_is_permutation_invariant_over_samples(data, agg, ratio, seed):
    s = LossSettings(ratio=ratio, alpha=0.875, loss_agg=agg, kl_coef=0.01)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    a, _ = compute_policy_loss(*_pack(data, list(range(len(data)))), s, 5.0)
    b, _ = compute_policy_loss(*_pack(data, order), s, 5.0)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(data=_samples(), agg=st.sampled_from(AGGS), ratio=st.sampled_from(RATIOS))
def test_zero_advantage_gives_zero_loss_and_gradient(data, agg, ratio):
    lp, old, ref, adv, mask, anchor, index = _pack(data, list(range(len(data))))
    lp.requires_grad_(True)
    s = LossSettings(ratio=ratio, alpha=0.875, loss_agg=agg)
    loss, _ = compute_policy_loss(lp, old, ref, torch.zeros_like(adv), mask, anchor, index, s, 3.0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(lp.grad) == 0


def test_settings_read_the_alpha_the_config_decided():
    from megatron_armor.config import load_config
    from megatron_armor.config.schema import ArmorConfig

    config = load_config(None, ["algo.alpha=auto", "algo.group_size=16"])
    assert config.algo.alpha == "auto" and config.resolved.alpha == 15 / 16  # decided once
    assert LossSettings.from_algo_config(config.algo, config.resolved.alpha).alpha == 15 / 16
    config = load_config(None, ["algo.alpha=0.875"])
    algo = config.algo
    settings = LossSettings.from_algo_config(algo, config.resolved.alpha, ref_metrics=False)
    assert settings.alpha == 0.875 and not settings.ref_metrics
    assert settings.clip_high == algo.clip_high and settings.loss_agg == algo.loss_agg
    built = ArmorConfig()  # a config built in code decides alike
    built.algo.group_size = 4
    assert built.resolved.alpha == 3 / 4
