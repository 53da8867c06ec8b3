"""Per-problem evaluation metrics over ``n`` sampled answers: avg@k, pass@k, maj@k.

Each function scores ONE problem; a benchmark's number is the mean over its problems
(:func:`mean_over_problems`). Validation in the paper reports avg@32 (docs/paper_configs.md).

- avg@k: mean correctness of the ``k`` samples, ``c / n``.
- pass@k: probability that at least one of ``k`` samples drawn without replacement from
  the ``n`` generated ones is correct; the unbiased estimator of Chen et al. (2021),
  ``1 - C(n - c, k) / C(n, k)``.
- maj@k: correctness of the majority-voted answer (votes over normalized extracted
  answers; samples without an extractable answer do not vote).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct out of ``n`` samples.

    Computed in the numerically stable product form
    ``C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)``, which never forms the
    (huge) binomial coefficients. When ``n - c < k`` every ``k``-subset holds a correct
    sample and the result is exactly 1.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(
            f"pass_at_k: k={k} must lie in [1, n={n}]; generate at least k samples per problem"
        )
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def avg_at_k(correct: Sequence[bool]) -> float:
    """Mean correctness of one problem's samples: ``c / n`` (0 for no samples)."""
    if not correct:
        return 0.0
    return sum(bool(x) for x in correct) / len(correct)


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample holding the most frequent answer; ``None`` if none voted.

    ``answers[i]`` is sample ``i``'s normalized extracted answer or ``None`` (no answer).
    Ties go to the answer that appeared first, so the vote is deterministic.
    """
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    for i, a in enumerate(answers):
        if a is not None and votes[a] == top:
            return i
    raise AssertionError("unreachable: a top-voted answer exists")


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """1.0 if the majority-voted answer is correct, else 0.0.

    ``answers`` and ``correct`` are aligned per sample; the majority answer's correctness is
    read from the first sample that gave it (correctness is a function of the normalized
    answer, so every sample with that answer agrees).
    """
    if len(answers) != len(correct):
        raise ValueError(
            f"maj_at_k: {len(answers)} answers but {len(correct)} correctness flags; "
            "pass one entry per sample to both"
        )
    winner = majority_answer(answers)
    return 0.0 if winner is None else float(bool(correct[winner]))


def mean_over_problems(values: Sequence[float]) -> float:
    """Benchmark score: the mean of per-problem values (0 for an empty benchmark)."""
    return sum(values) / len(values) if values else 0.0
