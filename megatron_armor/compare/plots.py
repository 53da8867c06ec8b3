"""PNGs of a comparison report: one figure per curve, every variant's across-seed mean with a
shaded 95% band, reference resets as dotted vertical lines in the variant's colour."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_armor.observability.plot import save_figure

TRAINING_TITLES = {
    "train_reward": "training reward (every on-policy sample, before the filter)",
    "train_acc": "training accuracy (every on-policy sample)",
    "kl_to_ref": "KL(policy || reference)",
    "acceptance_rate": "acceptance rate (accepted / queries seen)",
    "coverage_accepted": "coverage: training queries ever accepted",
    "coverage_trained": "coverage: training queries ever trained on",
}


def figure_name(key: str) -> str:
    """``val/tiny/avg@4`` -> ``val_tiny_avg4.png``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_").replace("_4", "4") + ".png"


def _plot(curves: dict[str, dict], resets: dict[str, list[int]], title: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (variant, c) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot(
            c["steps"], c["mean"], color=color, marker=".", label=f"{variant} (n={c['n_seeds']})"
        )
        ax.fill_between(c["steps"], c["low"], c["high"], color=color, alpha=0.2, linewidth=0)
        for step in resets.get(variant, []):
            ax.axvline(step, color=color, linestyle=":", linewidth=0.8)
    return save_figure(fig, ax, out, f"{title}\n(mean and 95% interval across seeds)", "", 7)


def plot_report(report: dict, out_dir: Path) -> list[Path]:
    """One PNG per validation metric and per training curve; returns the paths written."""
    variants = report["variants"]
    resets = {v: e["resets"] for v, e in variants.items()}
    figures = []
    for key in report["validation_metrics"]:
        curves = {v: e["validation"][key] for v, e in variants.items() if key in e["validation"]}
        figures.append(_plot(curves, resets, key, out_dir / figure_name(key)))
    for name, title in TRAINING_TITLES.items():
        curves = {v: e["training"][name] for v, e in variants.items() if name in e["training"]}
        if curves:
            figures.append(_plot(curves, resets, title, out_dir / figure_name(name)))
    return figures
