"""The over-optimization detector and the best-metric tracker on synthetic metric streams.
Tier: unit."""

from __future__ import annotations

import json
import random

import pytest

from megatron_armor.config.schema import OveroptConfig
from megatron_armor.observability.watchers import (
    BestTracker,
    OveroptDetector,
    fitted_rise,
    metric_value,
)

pytestmark = pytest.mark.unit

VAL_EVERY = 5
CONFIG = OveroptConfig(enabled=True, val_metric="val/*/avg@4", patience=3, reward_window=10,
                       min_reward_rise=0.02)  # fmt: skip


def stream(val_of, reward_of, steps: int, kl_of=lambda s: 0.001 * s):
    """Per-step metric dicts: reward and KL every step, two benchmarks every ``VAL_EVERY``."""
    for step in range(0, steps + 1):
        m = (
            {}
            if step == 0
            else {"reward/policy_mean": reward_of(step), "kl/exact_reverse": kl_of(step)}
        )
        if step % VAL_EVERY == 0:
            v = val_of(step // VAL_EVERY)
            m.update({"val/a/avg@4": v - 0.05, "val/b/avg@4": v + 0.05})
        yield step, m


def run(detector: OveroptDetector, metrics) -> list[int]:
    """Steps at which the detector fired."""
    return [step for step, m in metrics if detector.observe(step, m).get("overopt/fired")]


def rising_reward(step: int) -> float:
    return 0.2 + 0.004 * step


def test_rising_validation_never_fires():
    assert run(OveroptDetector(CONFIG), stream(lambda i: 0.2 + 0.01 * i, rising_reward, 300)) == []


def test_plateau_with_rising_reward_fires_after_patience():
    """Validation improves for 6 validations (to step 30), then stays flat: the 3rd validation
    without a new best (step 45) fires, once."""
    fired = run(
        OveroptDetector(CONFIG), stream(lambda i: 0.2 + 0.02 * min(i, 6), rising_reward, 120)
    )
    assert fired == [30 + CONFIG.patience * VAL_EVERY]


def test_falling_validation_fires_and_logs_the_evidence():
    detector = OveroptDetector(CONFIG)
    metrics = list(
        stream(lambda i: 0.4 - 0.02 * max(i - 4, 0) + 0.01 * min(i, 4), rising_reward, 60)
    )
    logged = {step: detector.observe(step, m) for step, m in metrics}
    fired = [s for s, m in logged.items() if m.get("overopt/fired")]
    assert fired == [35]
    evidence = logged[35]
    assert evidence["overopt/best_step"] == 20 and evidence["overopt/stale_validations"] == 3
    assert evidence["overopt/best_val"] == pytest.approx(0.44)
    assert evidence["overopt/reward_rise"] == pytest.approx(0.004 * 25)  # steps 10..35
    assert evidence["overopt/kl_growth"] == pytest.approx(0.001 * 25)
    assert detector.fired_step == 35


def test_plateau_without_rising_reward_does_not_fire():
    flat = run(
        OveroptDetector(CONFIG), stream(lambda i: 0.2 + 0.02 * min(i, 6), lambda s: 0.5, 120)
    )
    assert flat == []


def test_noisy_validation_gives_no_false_fire():
    """Stated noise level: uniform noise of amplitude n = 0.01 on a trend gaining b = 0.008 per
    validation; b * patience = 0.024 > 2 n, so every 3 validations bring a new best."""
    for seed in range(20):
        rng = random.Random(seed)
        noise = [rng.uniform(-0.01, 0.01) for _ in range(200)]
        fired = run(
            OveroptDetector(CONFIG),
            stream(lambda i, noise=noise: 0.2 + 0.008 * i + noise[i], rising_reward, 600),
        )
        assert fired == [], f"seed {seed}"


def test_kl_growth_can_be_required():
    cfg = OveroptConfig(**{**CONFIG.__dict__, "min_kl_growth": 0.01})
    plateau = lambda i: 0.2 + 0.02 * min(i, 6)  # noqa: E731
    assert (
        run(OveroptDetector(cfg), stream(plateau, rising_reward, 120, kl_of=lambda s: 0.01)) == []
    )
    assert run(OveroptDetector(cfg), stream(plateau, rising_reward, 120)) == [45]


def test_resumed_state_makes_the_same_decisions():
    """state_dict -> JSON -> a new detector at step 40 continues exactly like the uninterrupted one."""
    metrics = list(stream(lambda i: 0.2 + 0.02 * min(i, 6), rising_reward, 120))
    whole = OveroptDetector(CONFIG)
    expected = [whole.observe(step, m) for step, m in metrics]
    first = OveroptDetector(CONFIG)
    logged = [first.observe(step, m) for step, m in metrics[:41]]
    resumed = OveroptDetector(CONFIG)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    logged += [resumed.observe(step, m) for step, m in metrics[41:]]
    assert logged == expected and resumed.fired_step == 45


def test_metric_value_patterns_and_fitted_rise():
    m = {"val/a/avg@4": 0.2, "val/b/avg@4": 0.4, "val/a/pass@4": 0.9, "reward/policy_mean": None}
    assert metric_value(m, "val/*/avg@4") == pytest.approx(0.3)
    assert metric_value(m, "val/a/pass@4") == 0.9
    assert metric_value(m, "reward/policy_mean") is None and metric_value(m, "val/*/maj@4") is None
    assert fitted_rise([[0, 1.0], [10, 2.0], [20, 3.0]]) == pytest.approx(2.0)
    assert fitted_rise([[3, 1.0]]) is None


def test_best_tracker_max_min_and_resume():
    best = BestTracker("val/*/avg@4")
    assert not best.observe(1, {"reward/policy_mean": 0.3})
    assert best.observe(10, {"val/a/avg@4": 0.3}) and not best.observe(20, {"val/a/avg@4": 0.2})
    assert best.record() == {"step": 10, "metric": "val/*/avg@4", "value": 0.3, "mode": "max"}
    resumed = BestTracker("val/*/avg@4")
    resumed.load_state_dict(best.state_dict())
    assert resumed.observe(30, {"val/a/avg@4": 0.31}) and resumed.step == 30
    low = BestTracker("loss/pg", mode="min")
    assert low.observe(1, {"loss/pg": 0.5}) and low.observe(2, {"loss/pg": 0.4})
    assert not low.observe(3, {"loss/pg": 0.45})
