"""Where a run stands: its throughput and time left on the step line, and ``armor status``.

The ETA is the mean duration of the last ``ETA_WINDOW`` steps (validation and checkpoint
steps included, in their share) times the steps left. ``armor status RUN_DIR`` computes the
same from the run directory's files alone (``metrics.jsonl``, ``config.yaml``,
``checkpoints/``), so a login node without Ray or GPUs can watch a job.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

ETA_WINDOW = 20
"""Recent steps the ETA averages over."""
WARNING_KEYS = ("acceptance", "memory", "disk")
"""``watch/<name>_warning`` flags of the long-run watchers (``observability/health.py``)."""


class StepClock:
    """Durations of the recent steps -> the time the remaining ones take."""

    def __init__(self, window: int = ETA_WINDOW):
        self.seconds: deque[float] = deque(maxlen=window)

    def observe(self, step_s: float | None) -> None:
        if step_s is not None and math.isfinite(step_s):
            self.seconds.append(step_s)

    def eta(self, step: int, total: int) -> float | None:
        """Seconds until step ``total`` (``None`` before the first step's time)."""
        if not self.seconds:
            return None
        return sum(self.seconds) / len(self.seconds) * max(total - step, 0)


def format_duration(seconds: float) -> str:
    """``93`` -> ``1m33s``, ``5400`` -> ``1h30m``, ``200000`` -> ``2d07h``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_rate(per_s: float) -> str:
    """Tokens per second, short: ``950``, ``12.3k``, ``1.20M``."""
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f}M"
    return f"{per_s / 1e3:.1f}k" if per_s >= 1e3 else f"{per_s:.0f}"


def throughput_text(m: Mapping[str, Any]) -> str | None:
    """``gen 12.3k tok/s, train 45.6k tok/s`` from a step's ``perf/*`` metrics."""
    parts = [
        f"{label} {format_rate(m[key])} tok/s"
        for label, key in (
            ("gen", "perf/rollout_tokens_per_s"),
            ("train", "perf/train_tokens_per_s"),
        )
        if m.get(key) is not None and math.isfinite(m[key])
    ]
    return ", ".join(parts) or None


def warnings_of(m: Mapping[str, Any]) -> list[str]:
    """The warnings a step's line raises: watchers, skipped updates, a short batch, the detector."""
    found = [f"{name} trend" for name in WARNING_KEYS if m.get(f"watch/{name}_warning")]
    if m.get("train/skipped_updates"):
        found.append(f"{int(m['train/skipped_updates'])} skipped updates (non-finite)")
    if m.get("anchor/short_batch"):
        found.append("short batch")
    if m.get("overopt/fired"):
        found.append("over-optimization detected")
    return found


def run_eta(records: Sequence[Mapping[str, Any]], total: int) -> float | None:
    """The ETA from ``metrics.jsonl`` records (the last ``ETA_WINDOW`` steps' ``timing/step_s``)."""
    clock = StepClock()
    for record in records:
        if record.get("step", 0) > 0:
            clock.observe(record.get("timing/step_s"))
    return clock.eta(int(records[-1]["step"]), total) if records else None


def last_validation(records: Sequence[Mapping[str, Any]]) -> tuple[int, dict[str, float]] | None:
    """``(step, {bench/avg@k: value})`` of the newest record with validation metrics."""
    for record in reversed(records):
        vals = {k.removeprefix("val/"): v for k, v in record.items()
                if k.startswith("val/") and "avg@" in k and v is not None}  # fmt: skip
        if vals:
            return int(record["step"]), vals
    return None


def status_lines(
    records: Sequence[Mapping[str, Any]],
    total: int,
    checkpoints: Sequence[str],
    best: Mapping[str, Any] | None,
    now: float | None = None,
) -> list[str]:
    """What ``armor status`` prints for a run: step, ETA, throughput, last validation,
    warnings, checkpoints."""
    if not records:
        return ["no step logged yet"]
    last, now = records[-1], time.time() if now is None else now
    step = int(last["step"])
    ago = format_duration(max(now - float(last.get("wall_time", now)), 0.0))
    eta = run_eta(records, total)
    lines = [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%), logged {ago} ago"]
    if eta is not None:
        lines.append(f"ETA {format_duration(eta)} ({last.get('timing/step_s', 0):.1f} s last step)")
    if throughput_text(last):
        lines.append(f"throughput: {throughput_text(last)}")
    val = last_validation(records)
    if val is not None:
        values = ", ".join(f"{k} {v:.3f}" for k, v in sorted(val[1].items()))
        lines.append(f"validation (step {val[0]}): {values}")
    lines.append(f"warnings: {', '.join(warnings_of(last)) or 'none'}")
    lines.append(f"newest checkpoint: {checkpoints[-1] if checkpoints else 'none yet'}")
    if best:
        lines.append(f"best checkpoint: step {best['step']} ({best['metric']} {best['value']:.4f})")
    return lines
