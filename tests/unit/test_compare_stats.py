"""Statistics of `armor compare` on synthetic curves with known answers. Tier: unit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_armor.compare.stats import (
    auc,
    bootstrap_interval,
    curve_summary,
    paired_test,
    seed_band,
    sign_flip_p_value,
    t_quantile,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "df, expected", [(1, 12.706205), (2, 4.302653), (4, 2.776445), (10, 2.228139), (30, 2.042272)]
)
def test_t_quantile_matches_the_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-5)


def test_band_is_the_t_interval_of_the_seeds():
    values = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # mean 3, 4; sd 2 each
    band = seed_band(values)
    half = 4.302653 * 2 / math.sqrt(3)
    np.testing.assert_allclose(band.mean, [3.0, 4.0])
    np.testing.assert_allclose(band.low, [3 - half, 4 - half], rtol=1e-6)
    np.testing.assert_allclose(band.high, [3 + half, 4 + half], rtol=1e-6)
    assert band.n == 3


def test_band_ignores_a_missing_step_of_one_seed():
    values = np.array([[1.0, np.nan], [3.0, 4.0], [5.0, 6.0]])
    band = seed_band(values)
    half = 12.706205 * math.sqrt(2) / math.sqrt(2)  # seeds 4, 6: sd sqrt(2), n 2
    assert band.mean[1] == pytest.approx(5.0) and band.high[1] == pytest.approx(5 + half, rel=1e-6)
    assert band.n == 2


def test_one_seed_has_no_interval():
    band = seed_band(np.array([[0.2, 0.4]]))
    np.testing.assert_array_equal(band.low, band.high)


def test_auc_is_the_time_average():
    steps = np.arange(0, 11, 2)
    assert auc(steps, 0.3 + 0.02 * steps) == pytest.approx(0.3 + 0.02 * 5)  # linear: midpoint
    assert auc(steps, np.full(6, 0.7)) == pytest.approx(0.7)
    # a spike of height 1 at one inner step of spacing 2 over a span of 10: area 2 -> 0.2
    assert auc(steps, np.array([0, 0, 1, 0, 0, 0.0])) == pytest.approx(0.2)


def test_curve_summary_final_best_and_its_step():
    s = curve_summary(np.array([0, 10, 20, 30]), np.array([0.2, 0.5, 0.4, 0.1]))
    assert s["final"] == 0.1 and s["best"] == 0.5 and s["best_step"] == 10


def test_sign_flip_p_of_three_equal_sign_differences_is_its_floor():
    assert sign_flip_p_value(np.array([1.0, 2.0, 3.0])) == pytest.approx(2 / 8)
    # mean 0 -> every flip is at least as extreme
    assert sign_flip_p_value(np.array([1.0, -1.0, 2.0, -2.0])) == pytest.approx(1.0)
    # 6 positive of 6 distinct: only the two all-same-sign flips reach |mean|
    assert sign_flip_p_value(np.arange(1.0, 7.0)) == pytest.approx(2 / 64)


def test_bootstrap_of_constant_differences_is_that_constant():
    assert bootstrap_interval(np.full(4, 0.25)) == pytest.approx((0.25, 0.25))
    low, high = bootstrap_interval(np.array([0.0, 1.0, 2.0, 3.0]))
    assert 0.0 <= low < 1.5 < high <= 3.0


def test_paired_test_reports_n_and_the_smallest_attainable_p():
    a, b = np.array([0.5, 0.6, 0.7]), np.array([0.4, 0.5, 0.6])
    t = paired_test(a, b)
    assert (t.n, t.min_p_value) == (3, 0.25)
    assert t.mean_diff == pytest.approx(0.1) and t.ci_low == pytest.approx(0.1)
    assert t.p_value == pytest.approx(0.25)
    with pytest.raises(ValueError, match=">= 2 paired seeds"):
        paired_test(np.array([1.0]), np.array([0.0]))
