"""Statistics of a seeded comparison: bands across seeds, curve summaries, paired tests.

Everything is NumPy on small arrays (seeds x steps). Conventions:

- A *band* is the mean across ``S`` seeds and a two-sided Student-t interval,
  ``mean +- t_{(1+c)/2, S-1} * sd / sqrt(S)`` (sd with ``S - 1``); ``S = 1`` gives no interval.
- ``auc`` is the area under a curve by the trapezoid rule divided by the step span: the
  curve's time-average, in the metric's own units (a constant curve ``y`` has AUC ``y``).
- A paired comparison of variants ``A`` and ``B`` uses the per-seed differences
  ``d_s = A_s - B_s`` (same seed = same data order): their mean, a percentile bootstrap
  interval over seeds, and an exact sign-flip permutation p-value (two-sided). With ``n``
  seeds the smallest attainable p-value is ``2 / 2^n`` (0.25 for 3 seeds).
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np


def _t_pdf(x: np.ndarray, df: int) -> np.ndarray:
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))


def _t_cdf_above_zero(x: float, df: int, points: int = 4001) -> float:
    """``P(0 <= T <= x)`` by Simpson's rule on the substitution ``x = tan(u)`` (finite range)."""
    u = np.linspace(0.0, math.atan(x), points)
    f = _t_pdf(np.tan(u), df) / np.cos(u) ** 2
    h = u[1] - u[0]
    return float(h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))


def t_quantile(p: float, df: int) -> float:
    """The ``p``-quantile (``p`` in (0.5, 1)) of Student's t with ``df`` degrees of freedom."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile(p={p}, df={df}): need 0.5 < p < 1 and df >= 1")
    lo, hi = 0.0, 1.0
    while _t_cdf_above_zero(hi, df) < p - 0.5:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf_above_zero(mid, df) < p - 0.5 else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Band:
    """Mean and interval across seeds, per step (``[T]`` each); ``n`` seeds."""

    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    n: int


def seed_band(values: np.ndarray, confidence: float = 0.95) -> Band:
    """The t-interval band of ``values[S, T]`` (seeds x steps; NaN = missing, ignored per step)."""
    v = np.atleast_2d(np.asarray(values, dtype=np.float64))
    n = np.sum(~np.isnan(v), axis=0)
    with warnings.catch_warnings():  # steps with 0 or 1 seed: NaN spread, no interval below
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(v, axis=0)
        sd = np.nanstd(v, axis=0, ddof=1)
    if v.shape[0] < 2:
        return Band(mean, mean.copy(), mean.copy(), int(v.shape[0]))
    t = np.array([t_quantile((1 + confidence) / 2, int(k) - 1) if k >= 2 else np.nan for k in n])
    half = np.where(n >= 2, t * sd / np.sqrt(np.maximum(n, 1)), 0.0)
    return Band(mean, mean - half, mean + half, int(n.min()))


def auc(steps: np.ndarray, values: np.ndarray) -> float:
    """Trapezoid area under ``values`` over ``steps`` divided by the span (time-average)."""
    s, v = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if len(s) < 2 or s[-1] == s[0]:
        return float(v[-1]) if len(v) else float("nan")
    area = float(np.sum((v[1:] + v[:-1]) * np.diff(s)) / 2)
    return area / float(s[-1] - s[0])


def curve_summary(steps: np.ndarray, values: np.ndarray) -> dict[str, float]:
    """``final``, ``best`` (maximum), ``best_step``, ``auc`` of one validation curve."""
    v = np.asarray(values, dtype=np.float64)
    i = int(np.argmax(v))
    return {"final": float(v[-1]), "best": float(v[i]), "best_step": int(steps[i]),
            "auc": auc(steps, v)}  # fmt: skip


@dataclass(frozen=True)
class PairedTest:
    """``A - B`` over ``n`` paired seeds: mean difference, bootstrap interval, sign-flip p."""

    n: int
    mean_diff: float
    ci_low: float
    ci_high: float
    p_value: float
    min_p_value: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def bootstrap_interval(
    diffs: np.ndarray, confidence: float = 0.95, resamples: int = 10000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``diffs`` (seeds resampled with replacement)."""
    d = np.asarray(diffs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def sign_flip_p_value(diffs: np.ndarray) -> float:
    """Exact two-sided p of ``mean(d)`` under sign flips: ``P(|mean(+-d)| >= |mean(d)|)``."""
    d = np.asarray(diffs, dtype=np.float64)
    if len(d) > 20:
        raise ValueError(f"{len(d)} paired seeds: the exact test enumerates 2^n flips; use <= 20")
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    flipped = np.abs((signs * d).mean(axis=1))
    return float(np.mean(flipped >= abs(d.mean()) - 1e-12))


def paired_test(a: np.ndarray, b: np.ndarray, confidence: float = 0.95) -> PairedTest:
    """Paired comparison of per-seed values ``a[n]`` and ``b[n]`` (same seed order)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"paired test needs >= 2 paired seeds, got {a.shape} vs {b.shape}")
    d = a - b
    low, high = bootstrap_interval(d, confidence)
    return PairedTest(n=len(d), mean_diff=float(d.mean()), ci_low=low, ci_high=high,
                      p_value=sign_flip_p_value(d), min_p_value=2.0 / 2 ** len(d))  # fmt: skip
