"""Rollout correction (``algo/rollout_correction.py`` in ``algo/losses.py``): every mode's loss
and gradient against its formula written out token by token in float64, with anchors (whose
behaviour log-prob is ``lp_ref``), masked response tokens holding non-finite values, and
samples of unequal lengths; ``none`` leaves loss, gradient and metrics bit for bit as they
were. Tier: unit (pure torch)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_armor.algo import registry
from megatron_armor.algo.losses import (
    LossSettings,
    compute_policy_loss,
    count_units,
    dual_clip_pg_loss,
    finalize_metrics,
)
from megatron_armor.algo.rollout_correction import CorrectionSettings

pytestmark = pytest.mark.unit

F64 = torch.float64
TOL = 1e-12
MODES = ("token_tis", "seq_tis", "token_mask", "seq_mask", "icepop")
AGGS = ("token-mean", "seq-mean-token-mean")


def random_inputs(seed: int) -> dict:
    """Six samples (the last of each group of three an anchor) of 4-9 tokens: a prompt token
    (mask 0), response tokens, one response token masked out with a NaN engine log-prob; the
    engine log-probs differ from the trainer's by up to ±0.6 per token (ratios 0.55-1.8)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 10, (6,), generator=g).tolist()
    index = torch.repeat_interleave(torch.arange(6), torch.tensor(lengths))
    total = int(index.numel())
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    mask = torch.ones(total, dtype=F64)
    mask[starts] = 0.0  # the prompt token
    mask[starts + 2] = 0.0  # a response token outside the loss
    anchor = (index % 3 == 2) & (mask > 0)
    old = -2 * torch.rand(total, generator=g, dtype=F64)
    ref = -2 * torch.rand(total, generator=g, dtype=F64)
    behaviour = torch.where(anchor, ref, old)
    engine = behaviour + 1.2 * (torch.rand(total, generator=g, dtype=F64) - 0.5)
    engine[starts + 2] = math.nan
    adv = torch.randn(6, generator=g, dtype=F64)[index] * mask
    lp = old + 0.3 * torch.randn(total, generator=g, dtype=F64)
    return {"lp": lp, "old": old, "ref": ref, "engine": engine, "adv": adv, "mask": mask,
            "anchor": anchor, "index": index}  # fmt: skip


def formula_weights(x: dict, s: CorrectionSettings) -> list[float]:
    """Each token's weight by the formula of docs/algorithm.md, one token at a time."""
    rho, seq = {}, {}
    for t in range(len(x["mask"])):
        if x["mask"][t] > 0:
            b = x["ref"][t] if x["anchor"][t] else x["old"][t]
            rho[t] = math.exp(float(b - x["engine"][t]))
            seq.setdefault(int(x["index"][t]), []).append(rho[t])
    sample_ratio = {}
    for i, rhos in seq.items():
        product = math.prod(rhos)
        sample_ratio[i] = product ** (1 / len(rhos)) if s.seq_ratio == "geometric" else product

    def kept(r: float) -> bool:
        return s.low <= r <= s.high

    weights = []
    for t in range(len(x["mask"])):
        if t not in rho:
            weights.append(0.0)
            continue
        r_tok, r_seq = rho[t], sample_ratio[int(x["index"][t])]
        weights.append({
            "token_tis": min(r_tok, s.cap),
            "seq_tis": min(r_seq, s.cap),
            "token_mask": float(kept(r_tok)),
            "seq_mask": float(kept(r_seq)),
            "icepop": r_tok if kept(r_tok) else 0.0,
        }[s.mode])  # fmt: skip
    return weights


def loss_and_grad(x: dict, settings: LossSettings, engine=True):
    lp = x["lp"].clone().requires_grad_(True)
    normalizer = count_units(settings.loss_agg, x["mask"], x["index"])
    loss, metrics = compute_policy_loss(
        lp, x["old"], x["ref"], x["adv"], x["mask"], x["anchor"], x["index"], settings,
        normalizer, engine_logprobs=x["engine"] if engine else None,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), lp.grad, metrics


def formula_loss(x: dict, settings: LossSettings, weights: list[float]):
    """``sum_t m_t w_t l_t / N`` (token-mean) or ``sum_i mean_{t in i} w_t l_t / N_seq`` with the
    per-token dual-clip loss ``l_t`` of the same ratio mode."""
    lp = x["lp"].clone().requires_grad_(True)
    mode = registry.get_ratio(settings.ratio)
    log_r = mode.log_ratio(lp, x["old"], x["ref"], x["anchor"], settings.alpha)
    ratio = torch.exp(log_r.clamp(-settings.log_ratio_clamp, settings.log_ratio_clamp))
    lower, upper = mode.clip_range(settings.clip_low, settings.clip_high, settings.alpha)
    pg, _ = dual_clip_pg_loss(ratio, x["adv"], lower, upper, settings.dual_clip_c)
    terms = {}
    for t in range(len(weights)):
        if x["mask"][t] > 0:
            terms.setdefault(int(x["index"][t]), []).append(weights[t] * pg[t])
    if settings.loss_agg == "token-mean":
        loss = sum(sum(v) for v in terms.values()) / sum(len(v) for v in terms.values())
    else:
        loss = sum(sum(v) / len(v) for v in terms.values()) / len(terms)
    loss.backward()
    return loss.detach(), lp.grad


CASES = [(mode, "product") for mode in MODES] + [
    ("seq_tis", "geometric"),
    ("seq_mask", "geometric"),
]


@pytest.mark.parametrize(("mode", "seq_ratio"), CASES)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio", ["mixed", "standard"])
def test_each_mode_weights_the_clipped_term_by_its_formula(mode, seq_ratio, agg, ratio):
    x = random_inputs(seed=sum(map(ord, f"{mode}{seq_ratio}{agg}{ratio}")))
    # bounds inside the ratios' range, so that some tokens are truncated or masked
    correction = CorrectionSettings(mode=mode, cap=1.3, low=0.8, high=1.25, seq_ratio=seq_ratio)
    settings = LossSettings(ratio=ratio, alpha=0.75, loss_agg=agg, rollout_correction=correction)
    weights = formula_weights(x, correction)
    loss, grad, metrics = loss_and_grad(x, settings)
    want_loss, want_grad = formula_loss(x, settings, weights)
    assert abs(loss.item() - want_loss.item()) <= TOL
    torch.testing.assert_close(grad, want_grad, atol=TOL, rtol=0)
    m = finalize_metrics({k: float(v) for k, v in metrics.items()})
    on = x["mask"] > 0
    for source, sel in (("policy", on & ~x["anchor"]), ("anchor", on & x["anchor"])):
        w = torch.tensor(weights, dtype=F64)[sel]
        assert m[f"correction/{source}_weight_mean"] == pytest.approx(w.mean().item(), abs=TOL)
        assert m[f"correction/{source}_weight_max"] == pytest.approx(w.max().item(), abs=TOL)
        cut = m[f"correction/{source}_cut_frac"]
        assert 0.0 <= cut <= 1.0
    cuts = [m[f"correction/{s}_cut_frac"] for s in ("policy", "anchor")]
    if mode.startswith("token") or mode == "icepop":  # the bounds cut some tokens of each source
        assert all(c > 0 for c in cuts), cuts


def test_the_cut_fraction_counts_the_tokens_truncated_or_masked():
    x = random_inputs(seed=3)
    on = (x["mask"] > 0) & ~x["anchor"]
    rho = torch.exp(x["old"] - x["engine"])[on]
    for mode, cut in (("token_tis", rho > 1.3), ("token_mask", (rho < 0.8) | (rho > 1.25))):
        correction = CorrectionSettings(mode=mode, cap=1.3, low=0.8, high=1.25)
        _, _, metrics = loss_and_grad(x, LossSettings(rollout_correction=correction))
        m = finalize_metrics({k: float(v) for k, v in metrics.items()})
        assert m["correction/policy_cut_frac"] == pytest.approx(cut.double().mean().item())


def test_a_sequence_ratio_beyond_exp_range_is_truncated_or_masked_not_inf():
    """A long sample whose product of ratios overflows float64: ``seq_tis`` gives it the cap,
    ``seq_mask`` weight 0; nothing becomes inf or NaN."""
    x = random_inputs(seed=5)
    x["engine"] = torch.where(x["mask"] > 0, x["old"] - 200.0, x["engine"])  # rho = e^200 each
    for mode, weight in (("seq_tis", 1.3), ("seq_mask", 0.0)):
        correction = CorrectionSettings(mode=mode, cap=1.3, low=0.8, high=1.25)
        loss, grad, metrics = loss_and_grad(x, LossSettings(rollout_correction=correction))
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        m = finalize_metrics({k: float(v) for k, v in metrics.items()})
        assert m["correction/policy_weight_max"] == pytest.approx(weight)
        assert m["correction/policy_cut_frac"] == 1.0


@pytest.mark.parametrize("agg", AGGS)
def test_none_leaves_loss_gradient_and_metrics_bit_for_bit(agg):
    x = random_inputs(seed=7)
    settings = LossSettings(loss_agg=agg, alpha=0.75, kl_coef=0.1)
    assert settings.rollout_correction.mode == "none"
    without = loss_and_grad(x, settings, engine=False)
    with_engine = loss_and_grad(x, settings, engine=True)  # engine log-probs are not read
    assert torch.equal(without[0], with_engine[0]) and torch.equal(without[1], with_engine[1])
    assert without[2].keys() == with_engine[2].keys()
    assert all(torch.equal(without[2][k], with_engine[2][k]) for k in without[2])
    assert not any(k.startswith("correction/") for k in without[2])


def test_a_weight_is_never_differentiated():
    """The weights come from log-probs computed before the update: the gradient is that of
    ``w_t l_t`` with ``w_t`` held fixed, whatever the weights' inputs require."""
    x = random_inputs(seed=9)
    x["engine"] = x["engine"].clone().requires_grad_(True)  # read by the weight alone
    correction = CorrectionSettings(mode="icepop", low=0.8, high=1.25)
    _, grad, metrics = loss_and_grad(x, LossSettings(rollout_correction=correction))
    assert not metrics["correction/policy_weight_mean"].requires_grad
    assert x["engine"].grad is None and torch.isfinite(grad).all()


def test_an_applied_mode_needs_the_engine_logprobs():
    x = random_inputs(seed=1)
    settings = LossSettings(rollout_correction=CorrectionSettings(mode="token_tis"))
    with pytest.raises(ValueError, match="algo.rollout_correction.mode='token_tis'.*engine"):
        loss_and_grad(x, settings, engine=False)


def test_settings_are_read_from_the_loaded_config():
    from megatron_armor.config import load_config

    config = load_config(None, ["algo.rollout_correction.mode=seq_mask",
                                "algo.rollout_correction.seq_ratio=geometric",
                                "algo.rollout_correction.low=0.999"])  # fmt: skip
    got = LossSettings.from_algo_config(config.algo, config.resolved.alpha).rollout_correction
    assert got == CorrectionSettings(mode="seq_mask", low=0.999, seq_ratio="geometric")
    assert dataclasses.asdict(LossSettings().rollout_correction)["mode"] == "none"


@pytest.mark.parametrize(
    "override",
    [
        "algo.rollout_correction.mode=tis",
        "algo.rollout_correction.seq_ratio=mean",
        "algo.rollout_correction.cap=0",
        "algo.rollout_correction.low=2.5",
        "algo.rollout_correction.low=-0.1",
    ],
)
def test_bad_correction_settings_are_refused_at_load(override):
    from megatron_armor.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(None, [override])
