"""PNG curves of a run directory (``armor plot RUN_DIR``), drawn with matplotlib's Agg backend.

Figures (each with the reference resets as dashed vertical lines, and a red dotted line where
the over-optimization detector fired, ``overopt/fired``):

- ``reward_vs_val.png``: training reward (on-policy mean) against validation accuracy
  (``val/<bench>/avg@k``) — the paper's Fig. 1 view of over-optimization.
- ``kl.png``: ``kl/reverse_k1``, ``kl/reverse_k3`` (on-policy tokens), ``kl/forward_k1``
  (anchor tokens) and, when ``logging.exact_kl_every`` is on, the exact vocabulary-wide
  ``kl/exact_reverse`` / ``kl/exact_forward`` (the paper's Fig. 2 view).
- ``acceptance.png``: ``anchor/acceptance_rate``, ``anchor/ref_acc`` and the rejection shares.
- ``clip.png``: ``loss/clipfrac_low``, ``loss/clipfrac_high``, ``loss/dualclip_frac``.
- ``mismatch.png``: the engine/trainer mismatch per source, ``rollout/<source>_mismatch_k1``
  and ``_k3`` (KL(engine || trainer) estimates, docs/metrics.md).
- ``correction.png`` (with ``algo.rollout_correction`` on): the weights' mean and maximum and
  the truncated/masked fraction per source, ``correction/<source>_*``.
- ``memory.png``: host RSS of the whole run (``mem/run_gb``), of the driver and of the first
  process of each actor role, and each node's used memory (``mem/node<n>_used_gb``).
- ``disk.png``: the run directory and its newest checkpoint at the checkpoint steps.

A non-finite value (a skipped update's NaN) leaves a gap in its curve.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megatron_armor.observability.metrics import read_metrics

RESET_KEY = "reset/performed"
OVEROPT_KEY = "overopt/fired"
TRAIN_REWARD_KEYS = ("reward/policy_mean", "reward/mean")
SOURCES = ("policy", "anchor")
CORRECTION_KEYS = ("weight_mean", "weight_max", "cut_frac")


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over the records that have it; a non-finite value is
    NaN (matplotlib leaves a gap there)."""
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if value is not None:
            steps.append(int(r["step"]))
            values.append(float(value) if math.isfinite(value) else math.nan)
    return steps, values


def reset_steps(records: list[dict[str, Any]]) -> list[int]:
    """Steps at which the reference was reset."""
    return [int(r["step"]) for r in records if r.get(RESET_KEY)]


def _mark_resets(ax, resets: list[int]) -> None:
    for i, step in enumerate(resets):
        ax.axvline(
            step,
            color="grey",
            linestyle="--",
            linewidth=0.8,
            label="reference reset" if i == 0 else None,
        )


def _mark_overopt(ax, records: list[dict[str, Any]]) -> None:
    for step in (int(r["step"]) for r in records if r.get(OVEROPT_KEY)):
        ax.axvline(step, color="tab:red", linestyle=":", linewidth=1.2,
                   label="over-optimization detected")  # fmt: skip


def _line_plot(records, keys, title, ylabel, out: Path, resets) -> Path | None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for key in keys:
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, marker=".", label=key)
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    _mark_resets(ax, resets)
    _mark_overopt(ax, records)
    return save_figure(fig, ax, out, title, ylabel)


def save_figure(fig, ax, out: Path, title: str, ylabel: str = "", legend_size: int = 8) -> Path:
    """Title, step axis, grid and legend on ``ax``; ``fig`` written to ``out`` and closed."""
    import matplotlib.pyplot as plt

    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _reward_vs_val(records, out: Path, resets) -> Path | None:
    import matplotlib.pyplot as plt

    reward_key = next((k for k in TRAIN_REWARD_KEYS if series(records, k)[0]), None)
    val_keys = sorted({k for r in records for k in r if k.startswith("val/") and "avg@" in k})
    if reward_key is None and not val_keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if reward_key:
        ax.plot(*series(records, reward_key), color="tab:blue", marker=".", label=reward_key)
    ax.set(xlabel="step", ylabel="training reward", title="training reward vs validation accuracy")
    ax2 = ax.twinx()
    for i, key in enumerate(val_keys):
        ax2.plot(*series(records, key), color=f"C{i + 1}", marker="o", linestyle="-", label=key)
    ax2.set_ylabel("validation accuracy")
    _mark_resets(ax, resets)
    _mark_overopt(ax, records)
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


MEMORY_KEYS = ("mem/run_gb", "mem/driver_gb", "mem/trainer0_gb", "mem/rollout0_gb",
               "mem/reward0_gb")  # fmt: skip


def memory_keys(records: list[dict[str, Any]]) -> list[str]:
    """:data:`MEMORY_KEYS` and every node's ``mem/node<n>_used_gb`` found in ``records``."""
    nodes = sorted({k for r in records for k in r if k.startswith("mem/node") and
                    k.endswith("_used_gb")})  # fmt: skip
    return [*MEMORY_KEYS, *nodes]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write every figure that has data into ``out_dir`` (default ``run_dir/plots``)."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(
            f"{run_dir}/metrics.jsonl has no records; is {run_dir} a run directory?"
        )
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    resets = reset_steps(records)
    written = [
        _reward_vs_val(records, out / "reward_vs_val.png", resets),
        _line_plot(
            records,
            (
                "kl/reverse_k1",
                "kl/reverse_k3",
                "kl/forward_k1",
                "kl/exact_reverse",
                "kl/exact_forward",
            ),  # fmt: skip
            "KL to the reference",
            "nats / token",
            out / "kl.png",
            resets,
        ),
        _line_plot(
            records,
            (
                "anchor/acceptance_rate",
                "anchor/ref_acc",
                "anchor/rejected_all_correct_frac",
                "anchor/rejected_all_wrong_frac",
                "anchor/rejected_no_ref_correct_frac",
            ),
            "anchor acceptance",
            "fraction of queries seen",
            out / "acceptance.png",
            resets,
        ),
        _line_plot(
            records,
            ("loss/clipfrac_low", "loss/clipfrac_high", "loss/dualclip_frac"),
            "clipped token fractions",
            "fraction of tokens",
            out / "clip.png",
            resets,
        ),
        _line_plot(
            records,
            tuple(f"rollout/{s}_mismatch_{k}" for s in SOURCES for k in ("k1", "k3")),
            "engine/trainer mismatch, KL(engine || trainer)",
            "nats / token",
            out / "mismatch.png",
            resets,
        ),
        _line_plot(
            records,
            tuple(f"correction/{s}_{k}" for s in SOURCES for k in CORRECTION_KEYS),
            "rollout correction weights",
            "weight / fraction of tokens",
            out / "correction.png",
            resets,
        ),
        _line_plot(
            records, memory_keys(records), "host memory (RSS)", "GB", out / "memory.png", resets
        ),
        _line_plot(
            records,
            ("disk/run_dir_gb", "disk/checkpoint_gb"),
            "run directory",
            "GB",
            out / "disk.png",
            resets,
        ),
    ]
    return [p for p in written if p is not None]
