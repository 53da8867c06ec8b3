"""Metric watchers of a run: the best value of a metric, and the over-optimization detector.

Both read the per-step metric dicts the loop logs and keep a small, JSON-serialisable state
(``state_dict``/``load_state_dict``) that the orchestrator checkpoints, so a resumed run makes
the same decisions as an uninterrupted one. Pure Python: no torch, no I/O.

Over-optimization (arXiv 2607.10481 §1, §5.1): the training reward keeps rising while the
validation accuracy stops improving or falls; the paper then takes the best checkpoint before
the decline and continues from it. :class:`OveroptDetector` fires when

* the validation metric has not exceeded ``best + min_delta`` for ``patience`` validations, and
* the training reward rose since the best validation: the least-squares line through the
  reward of steps ``best_step - reward_window .. now`` climbs by more than ``min_reward_rise``
  over that span (``overopt/reward_rise``);
* optionally (``min_kl_growth >= 0``) the KL to the start model grew the same way by more than
  ``min_kl_growth`` (``overopt/kl_growth``, always logged as the secondary signal).

Noise: with validation values ``v_i = trend_i + e_i``, ``|e_i| <= n``, a trend that gains at
least ``b`` per validation never fires the detector when ``b * patience > 2 n + min_delta``
(the value ``patience`` validations after the best exceeds it); a noisier or flatter curve
needs a larger ``patience``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from megatron_armor.config.schema import OveroptConfig


def metric_value(metrics: Mapping[str, float | None], name: str) -> float | None:
    """``metrics[name]``, or for a ``*`` pattern the mean over the matching keys (``None`` if
    absent): ``val/*/avg@32`` is the mean avg@32 over the validation benchmarks."""
    if "*" not in name:
        value = metrics.get(name)
        return None if value is None else float(value)
    values = [
        float(v) for k, v in metrics.items() if v is not None and fnmatch.fnmatchcase(k, name)
    ]
    return sum(values) / len(values) if values else None


def least_squares(points: list[list[float]]) -> tuple[float, float, float, float] | None:
    """``(slope, intercept, sigma, slope_se)`` of the least-squares line ``y = slope x +
    intercept`` through ``(x, y)`` points: ``sigma`` the residual std over ``n - 2`` degrees
    of freedom (0 with two points), ``slope_se = sigma / sqrt(sum (x - mean x)^2)`` the
    slope's standard error; ``None`` with fewer than two distinct ``x``."""
    if len(points) < 2:
        return None
    xs, ys = [float(s) for s, _ in points], [v for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    sse = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys, strict=True))
    sigma = (sse / (len(xs) - 2)) ** 0.5 if len(xs) > 2 else 0.0
    return slope, intercept, sigma, sigma / sxx**0.5


def fitted_rise(points: list[list[float]]) -> float | None:
    """Rise of the least-squares line through ``(step, value)`` points over their step span
    (``slope * (last_step - first_step)``); ``None`` with fewer than two distinct steps."""
    fit = least_squares(points)
    if fit is None:
        return None
    return fit[0] * (float(points[-1][0]) - float(points[0][0]))


@dataclass
class BestTracker:
    """The best value of ``metric`` so far (``mode`` ``max`` or ``min``) and its step."""

    metric: str
    mode: str = "max"
    step: int | None = None
    value: float | None = None

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> bool:
        """Take the step's metrics; ``True`` when they hold a new best."""
        value = metric_value(metrics, self.metric)
        if value is None:
            return False
        better = self.value is None or (
            value > self.value if self.mode == "max" else value < self.value
        )
        if better:
            self.step, self.value = step, value
        return better

    def record(self) -> dict | None:
        """``{"step", "metric", "value", "mode"}`` of the best so far (``None`` before one)."""
        if self.step is None:
            return None
        return {"step": self.step, "metric": self.metric, "value": self.value, "mode": self.mode}

    def state_dict(self) -> dict:
        return {"step": self.step, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.value = state.get("step"), state.get("value")


@dataclass
class OveroptState:
    """What the detector remembers (JSON-serialisable)."""

    best_val: float | None = None
    best_step: int = 0
    stale: int = 0
    rewards: list[list[float]] = field(default_factory=list)
    """``[step, reward]`` from ``best_step - reward_window`` on."""
    kls: list[list[float]] = field(default_factory=list)
    """``[step, kl]`` over the same steps."""
    fired_step: int | None = None


class OveroptDetector:
    """Over-optimization detector (see module docstring); ``observe`` once per logged step."""

    def __init__(self, config: OveroptConfig):
        self.config = config
        self.state = OveroptState()

    @property
    def fired_step(self) -> int | None:
        return self.state.fired_step

    def _window(self, series: list[list[float]]) -> list[list[float]]:
        """The points of ``series`` from ``best_step - reward_window`` on."""
        start = self.state.best_step - self.config.reward_window
        return [point for point in series if point[0] >= start]

    def _record(self, step: int, metrics: Mapping[str, float | None]) -> None:
        for series, name in ((self.state.rewards, self.config.reward_metric),
                             (self.state.kls, self.config.kl_metric)):  # fmt: skip
            value = metric_value(metrics, name)
            if value is not None:
                series.append([step, value])

    def _update_best(self, step: int, val: float) -> None:
        s = self.state
        if s.best_val is None or val > s.best_val + self.config.min_delta:
            s.best_val, s.best_step, s.stale = val, step, 0
            s.rewards, s.kls = self._window(s.rewards), self._window(s.kls)  # drop older steps
        else:
            s.stale += 1

    def _signals_hold(self, reward_rise: float | None, kl_growth: float | None) -> bool:
        c = self.config
        if self.state.stale < c.patience or reward_rise is None or reward_rise <= c.min_reward_rise:
            return False
        return c.min_kl_growth < 0 or (kl_growth is not None and kl_growth > c.min_kl_growth)

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> dict[str, float]:
        """Record the step's reward and KL; on a validation step decide and return the evidence
        as ``overopt/*`` metrics (``overopt/fired`` is 1 at the step it fires, once)."""
        self._record(step, metrics)
        val = metric_value(metrics, self.config.val_metric)
        if val is None:
            return {}
        self._update_best(step, val)
        reward_rise = fitted_rise(self._window(self.state.rewards))
        kl_growth = fitted_rise(self._window(self.state.kls))
        fires = self.state.fired_step is None and self._signals_hold(reward_rise, kl_growth)
        if fires:
            self.state.fired_step = step
        out = {"overopt/val": val, "overopt/best_val": self.state.best_val,
               "overopt/best_step": float(self.state.best_step),
               "overopt/stale_validations": float(self.state.stale),
               "overopt/fired": 1.0 if fires else 0.0}  # fmt: skip
        if reward_rise is not None:
            out["overopt/reward_rise"] = reward_rise
        if kl_growth is not None:
            out["overopt/kl_growth"] = kl_growth
        return out

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = OveroptState(**state)
