"""Human-readable output: a one-line summary per step and a table at the end of a run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_armor.observability.metrics import non_finite_keys, read_metrics
from megatron_armor.observability.status import format_duration, throughput_text

# (label, metric key, format) of the end-of-run table, in display order.
SUMMARY_ROWS: tuple[tuple[str, str, str], ...] = (
    ("train reward (on-policy)", "reward/policy_mean", "{:+.3f}"),
    ("train acc (on-policy)", "reward/policy_acc", "{:.3f}"),
    ("anchor reward", "reward/anchor_mean", "{:+.3f}"),
    ("acceptance rate", "anchor/acceptance_rate", "{:.3f}"),
    ("reference acc", "anchor/ref_acc", "{:.3f}"),
    ("gen batches / step", "anchor/gen_batches", "{:.1f}"),
    ("response length", "length/policy_mean", "{:.1f}"),
    ("policy loss", "loss/pg", "{:+.4f}"),
    ("clipfrac high", "loss/clipfrac_high", "{:.4f}"),
    ("KL reverse k3", "kl/reverse_k3", "{:.5f}"),
    ("KL forward k1 (anchors)", "kl/forward_k1", "{:.5f}"),
    ("KL exact reverse", "kl/exact_reverse", "{:.5f}"),
    ("alpha", "algo/alpha", "{:.4f}"),
    ("step time (s)", "timing/step_s", "{:.1f}"),
)


def _fmt(fmt: str, value: Any) -> str:
    return "-" if value is None else fmt.format(value)


def step_line(step: int, total: int, m: dict[str, Any], eta_s: float | None = None) -> str:
    """One line per step: rewards, acceptance, validation, KL, throughput, time and ETA."""
    parts = [f"step {step}/{total}"]
    if m.get("reward/policy_mean") is not None:
        parts.append(f"reward {m['reward/policy_mean']:+.3f}")
    if m.get("reward/anchor_mean") is not None:
        parts.append(f"anchor {m['reward/anchor_mean']:+.3f}")
    if m.get("anchor/acceptance_rate") is not None:
        parts.append(
            f"accept {m['anchor/acceptance_rate']:.2f} ({int(m.get('anchor/gen_batches') or 0)} gen)"
        )
    if m.get("anchor/short_batch"):
        parts.append(f"SHORT batch of {int(m.get('anchor/kept') or 0)}")
    for key in sorted(k for k in m if k.startswith("val/") and "avg@" in k):
        if m[key] is not None:
            parts.append(f"{key.removeprefix('val/')} {m[key]:.3f}")
    if m.get("kl/reverse_k3") is not None:
        parts.append(f"kl {m['kl/reverse_k3']:.4f}")
    if m.get("reset/performed"):
        parts.append("RESET")
    if m.get("train/skipped_updates"):
        parts.append(f"SKIPPED {int(m['train/skipped_updates'])}/{int(m['train/updates'])} "
                     "updates (non-finite loss or grad norm)")  # fmt: skip
    bad = non_finite_keys(m)
    if bad:
        more = f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""
        parts.append(f"NON-FINITE {', '.join(bad[:4])}{more}")
    if m.get("mem/run_gb") is not None:
        parts.append(f"mem {m['mem/run_gb']:.2f}G")
    warnings = [w for w in ("acceptance", "memory", "disk") if m.get(f"watch/{w}_warning")]
    if warnings:
        parts.append("WARN " + ",".join(warnings))
    rate = throughput_text(m)
    if rate:
        parts.append(rate)
    if m.get("timing/step_s") is not None:
        parts.append(f"{m['timing/step_s']:.1f}s")
    if eta_s is not None and step < total:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


def _max(values: list[float]) -> float:
    """The largest finite value (NaN when there is none: ``max`` is undefined with NaN)."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def summarize(records: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """Rows ``(label, first, last, best)`` for the metrics present in ``records``."""
    rows = []
    for label, key, fmt in SUMMARY_ROWS:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            rows.append(
                (label, _fmt(fmt, values[0]), _fmt(fmt, values[-1]), _fmt(fmt, _max(values)))
            )
    val_keys = sorted({k for r in records for k in r if k.startswith("val/") and "@" in k})
    for key in val_keys:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            rows.append((key, f"{values[0]:.3f}", f"{values[-1]:.3f}", f"{_max(values):.3f}"))
    return rows


def write_summary(run_dir: str | Path, extra: dict[str, Any] | None = None) -> str:
    """Render the end-of-run table (rich), save it as ``summary.txt`` + ``summary.json``."""
    from rich.console import Console
    from rich.table import Table

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    rows = summarize(records)
    table = Table(title=f"run summary: {run_dir}")
    for col in ("metric", "first", "last", "max"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for row in rows:
        table.add_row(*row)
    resets = [int(r["step"]) for r in records if r.get("reset/performed")]
    steps = max((int(r["step"]) for r in records), default=0)
    info = {"steps": steps, "reference_resets": resets, **(extra or {})}
    console = Console(record=True, width=100)
    console.print(table)
    for key, value in info.items():
        console.print(f"{key}: {value}")
    text = console.export_text()
    (run_dir / "summary.txt").write_text(text)
    summary = {
        "rows": [dict(zip(("metric", "first", "last", "max"), r, strict=True)) for r in rows],
        **info,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return text
