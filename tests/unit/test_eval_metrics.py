"""Unit tier: avg@k / pass@k / maj@k (no devices, no processes)."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_armor.evaluation.metrics import (
    avg_at_k,
    maj_at_k,
    majority_answer,
    mean_over_problems,
    pass_at_k,
)

pytestmark = pytest.mark.unit


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in s) for s in subsets)
    return hits / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_subset_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_closed_form_large_n_is_stable():
    n, c, k = 1000, 3, 32
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)


def test_pass_at_1_is_accuracy():
    assert pass_at_k(32, 8, 1) == pytest.approx(0.25)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_avg_at_k():
    assert avg_at_k([True, False, True, True]) == pytest.approx(0.75)
    assert avg_at_k([]) == 0.0


def test_majority_vote_ignores_missing_answers_and_breaks_ties_by_first():
    assert majority_answer(["3", None, "4", "4", None, None]) == 2
    assert majority_answer(["5", "4", "4", "5"]) == 0
    assert majority_answer([None, None]) is None


def test_maj_at_k():
    assert maj_at_k(["4", "4", "3"], [True, True, False]) == 1.0
    assert maj_at_k(["3", "3", "4"], [False, False, True]) == 0.0
    assert maj_at_k([None, None], [False, False]) == 0.0
    with pytest.raises(ValueError, match="one entry per sample"):
        maj_at_k(["1"], [True, False])


def test_mean_over_problems():
    assert mean_over_problems([1.0, 0.0, 0.5]) == pytest.approx(0.5)
    assert mean_over_problems([]) == 0.0
