"""The comparison report: ``report.json``, ``report.md`` and one PNG per curve in one folder.

Per variant and validation metric: the mean and a 95% t-interval across seeds at every step,
and per seed the final value, the best value and the area under the curve (time-averaged,
:func:`~megatron_armor.compare.stats.auc`), summarised the same way. Training curves: reward
of every on-policy sample, KL to the reference (exact when logged), acceptance rate, and
coverage (fraction of the training queries ever accepted / ever trained on). Paired
comparisons (``pairs:`` in the spec) test ``A - B`` on final / best / AUC over the seeds both
variants share.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_armor.compare.collect import TRAINING_KEYS, Curves, collect_variant
from megatron_armor.compare.spec import CompareSpec, run_config, run_status
from megatron_armor.compare.stats import curve_summary, paired_test, seed_band

CONFIDENCE = 0.95
SUMMARIES = ("final", "best", "auc")
COVERAGE = ("coverage_accepted", "coverage_trained")


def _band_dict(values: np.ndarray) -> dict[str, float]:
    band = seed_band(np.asarray(values, dtype=np.float64)[:, None], CONFIDENCE)
    return {"mean": float(band.mean[0]), "low": float(band.low[0]), "high": float(band.high[0]),
            "n": band.n}  # fmt: skip


def per_seed_summaries(curves: Curves, key: str) -> dict[str, list]:
    """``{seeds: [...], final|best|auc: [one value per finished seed]}``."""
    out: dict[str, list] = {"seeds": [], **{s: [] for s in SUMMARIES}}
    for seed, done, row in zip(curves.seeds, curves.finished, curves.values[key], strict=True):
        ok = ~np.isnan(row)
        if not done or not ok.any():
            continue
        out["seeds"].append(seed)
        summary = curve_summary(curves.steps[key][ok], row[ok])
        for s in SUMMARIES:
            out[s].append(summary[s])
    return out


def curve_entry(curves: Curves, key: str, with_summaries: bool) -> dict:
    """Band over steps (and per-seed summaries with their across-seed bands)."""
    band = seed_band(curves.values[key], CONFIDENCE)
    entry = {"steps": curves.steps[key].tolist(), "mean": band.mean.tolist(),
             "low": band.low.tolist(), "high": band.high.tolist(), "n_seeds": band.n}  # fmt: skip
    if with_summaries:
        seeds = per_seed_summaries(curves, key)
        entry["per_seed"] = seeds
        entry["summary"] = {s: _band_dict(seeds[s]) for s in SUMMARIES if seeds[s]}
    return entry


def variant_entry(curves: Curves, val_keys: list[str]) -> dict:
    """Everything the report says about one variant."""
    training = {}
    for name in (*TRAINING_KEYS, *COVERAGE):
        if name in curves.values:
            entry = curve_entry(curves, name, with_summaries=False)
            rows = [r for r, done in zip(curves.values[name], curves.finished, strict=True) if done]
            finals = [row[~np.isnan(row)][-1] for row in rows]
            means = [np.nanmean(row) for row in rows]
            if rows:
                entry.update(final=_band_dict(finals), mean_over_steps=_band_dict(means))
            entry["metric_key"] = curves.sources.get(name, name)
            training[name] = entry
    return {"seeds": curves.seeds, "resets": curves.resets,
            "validation": {k: curve_entry(curves, k, True) for k in val_keys if k in curves.values},
            "training": training}  # fmt: skip


def pair_entries(spec: CompareSpec, variants: dict[str, dict], val_keys: list[str]) -> list[dict]:
    """Paired tests of ``A - B`` on every validation metric and summary."""
    out = []
    for a, b in [p for p in spec.pairs if set(p) <= set(variants)]:
        for key in val_keys:
            va, vb = variants[a]["validation"].get(key), variants[b]["validation"].get(key)
            if va is None or vb is None:
                continue
            shared = sorted(set(va["per_seed"]["seeds"]) & set(vb["per_seed"]["seeds"]))
            if len(shared) < 2:
                continue
            for s in SUMMARIES:
                pick = [dict(zip(v["per_seed"]["seeds"], v["per_seed"][s], strict=True))
                        for v in (va, vb)]  # fmt: skip
                test = paired_test(np.array([pick[0][x] for x in shared]),
                                   np.array([pick[1][x] for x in shared]), CONFIDENCE)  # fmt: skip
                out.append({"a": a, "b": b, "metric": key, "summary": s, "seeds": shared,
                            **test.as_dict()})  # fmt: skip
    return out


def build_report(spec: CompareSpec, command: str = "") -> dict:
    """The report as a JSON-able dict (also the input of the markdown and the plots)."""
    collected = {v: collect_variant(spec, v) for v in spec.variants}
    curves = {v: c for v, c in collected.items() if c is not None}
    val_keys = sorted({k for c in curves.values() for k in c.values if k.startswith("val/")})
    variants = {v: variant_entry(c, val_keys) for v, c in curves.items()}
    unfinished = [r.label for r in spec.runs if run_status(r, run_config(r).run.steps) != "done"]
    return {"name": spec.name, "command": command, "seeds": list(spec.seeds),
            "confidence": CONFIDENCE, "validation_metrics": val_keys, "variants": variants,
            "pairs": pair_entries(spec, variants, val_keys), "unfinished": unfinished}  # fmt: skip


def write_report(spec: CompareSpec, command: str = "", out_dir: Path | None = None) -> Path:
    """``report.json``, ``report.md`` and ``*.png`` in ``out_dir`` (default: the spec's)."""
    from megatron_armor.compare.markdown import render_markdown
    from megatron_armor.compare.plots import plot_report

    out = Path(out_dir or spec.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(spec, command)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    figures = plot_report(report, out)
    (out / "report.md").write_text(render_markdown(report, [f.name for f in figures]))
    return out
