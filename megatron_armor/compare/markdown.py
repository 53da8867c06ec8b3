"""``report.md`` of a comparison: tables of the report dict (``compare/report.py``)."""

from __future__ import annotations


def _ci(entry: dict | None, digits: int = 3) -> str:
    if entry is None:
        return "—"
    if entry["n"] < 2:
        return f"{entry['mean']:.{digits}f}"
    return f"{entry['mean']:.{digits}f} [{entry['low']:.{digits}f}, {entry['high']:.{digits}f}]"


def _validation_tables(report: dict) -> list[str]:
    lines = []
    for key in report["validation_metrics"]:
        lines += [f"### `{key}`", "", "| variant | n finished | final | best | AUC (time-average) |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for variant, entry in report["variants"].items():
            curve = entry["validation"].get(key)
            if curve is not None:
                s = curve["summary"]
                lines.append(f"| {variant} | {len(curve['per_seed']['seeds'])} | "
                             f"{_ci(s.get('final'))} | {_ci(s.get('best'))} | "
                             f"{_ci(s.get('auc'))} |")  # fmt: skip
        lines.append("")
    return lines


def _training_table(report: dict) -> list[str]:
    cols = [("train_reward", "mean_over_steps", "training reward (mean over steps)"),
            ("train_reward", "final", "training reward (final)"),
            ("kl_to_ref", "final", "KL to reference (final)"),
            ("acceptance_rate", "mean_over_steps", "acceptance rate (mean)"),
            ("coverage_accepted", "final", "coverage: ever accepted"),
            ("coverage_trained", "final", "coverage: ever trained on")]  # fmt: skip
    lines = ["| variant | " + " | ".join(c[2] for c in cols) + " |",
             "|---|" + "---|" * len(cols)]  # fmt: skip
    for variant, entry in report["variants"].items():
        cells = [_ci(entry["training"].get(n, {}).get(field))
                 for n, field, _ in cols]  # fmt: skip
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    keys = {e["training"]["kl_to_ref"]["metric_key"]
            for e in report["variants"].values() if "kl_to_ref" in e["training"]}  # fmt: skip
    if keys:
        lines += ["", f"KL to reference is `{'`, `'.join(sorted(keys))}` (docs/metrics.md)."]
    return lines


def _pairs_table(report: dict) -> list[str]:
    if not report["pairs"]:
        return [
            "No paired comparisons: none in the spec (`pairs:`), or fewer than 2 seeds that "
            "both variants of a pair have run."
        ]
    n = min(p["n"] for p in report["pairs"])
    lines = [
        f"Paired over seeds (same seed = same data order); A - B per seed, mean, 95% percentile "
        f"bootstrap interval over seeds, exact two-sided sign-flip p. With n = {n} seeds the "
        f"smallest p this test can give is {2 / 2**n:.3f}, and the intervals are wide: a "
        "difference that is not significant here is not evidence of no difference.",
        "", "| A | B | metric | summary | n | A - B | 95% bootstrap | p (sign flip) |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for p in report["pairs"]:
        lines.append(f"| {p['a']} | {p['b']} | `{p['metric']}` | {p['summary']} | {p['n']} | "
                     f"{p['mean_diff']:+.3f} | [{p['ci_low']:+.3f}, {p['ci_high']:+.3f}] | "
                     f"{p['p_value']:.3f} |")  # fmt: skip
    return lines


def render_markdown(report: dict, figures: list[str]) -> str:
    """The whole report page."""
    seeds = report["seeds"]
    head = [f"# Comparison `{report['name']}`", "",
            f"Seeds: {seeds} (n = {len(seeds)}). Values are the mean across seeds and a "
            f"{report['confidence']:.0%} Student-t interval in brackets; few seeds give wide "
            "intervals. AUC is the area under the validation curve divided by the step span.",
            ""]  # fmt: skip
    if report.get("unfinished"):
        head += [f"**Unfinished runs** (their logged steps are included, or they are absent if "
                 f"they never started): {', '.join(report['unfinished'])}.", ""]  # fmt: skip
    if report.get("command"):
        head += ["Command:", "", "```bash", report["command"], "```", ""]
    body = ["## Validation", "", *_validation_tables(report), "## Training", "",
            *_training_table(report), "", "## Paired comparisons", "", *_pairs_table(report),
            "", "## Figures", "", *[f"![{f}]({f})" for f in figures], ""]  # fmt: skip
    return "\n".join(head + body)
