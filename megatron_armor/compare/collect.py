"""Read a comparison's runs into per-variant ``seeds x steps`` arrays.

Sources per run directory: ``metrics.jsonl`` (``val/*`` curves, training reward, KL to the
reference, acceptance rate, resets) and ``anchors/step_*.jsonl[.gz]`` (the query ids accepted per
step, docs/metrics.md), from which *coverage* is computed: the fraction of the training
queries (the first ``data.train_limit`` rows when set) ever accepted (and ever trained on,
i.e. kept) up to each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_armor.compare.spec import CompareSpec, run_config, run_status
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.data.sampler import sampled_prompt_count
from megatron_armor.observability.metrics import read_metrics
from megatron_armor.observability.plot import reset_steps
from megatron_armor.orchestration.step.step_metrics import anchor_file_steps, read_anchor_file

TRAINING_KEYS = {
    "train_reward": ("reward/policy_mean",),
    "train_acc": ("reward/policy_acc",),
    "kl_to_ref": ("kl/exact_reverse", "kl/reverse_k1"),
    "acceptance_rate": ("anchor/acceptance_rate",),
}
"""Training curves in the report: name -> metric keys, the first one a run logs is used."""


@dataclass
class Curves:
    """One variant: ``steps[T]`` and ``values[S, T]`` (NaN where a seed lacks the step) per key;
    ``finished[S]``: the seed's run reached its last step (only those enter final/best/AUC)."""

    seeds: list[int]
    finished: list[bool] = field(default_factory=list)
    steps: dict[str, np.ndarray] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    resets: list[int] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)


def last_per_step(records: list[dict]) -> dict[int, dict]:
    """``{step: record}``, the last record of each step winning (a resume rewrites steps)."""
    return {int(r["step"]): r for r in records}


def validation_keys(records: list[dict]) -> list[str]:
    """``val/<bench>/<metric>`` keys (``/n`` counts left out), sorted."""
    return sorted({k for r in records for k in r if k.startswith("val/") and not k.endswith("/n")})


def count_train_queries(config: ArmorConfig) -> int:
    """The denominator of coverage: the training queries the sampler draws from, i.e. the rows
    of ``data.train_files``, only the first ``data.train_limit`` of them when it is set."""
    import pyarrow.parquet as pq

    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in config.data.train_files)
    return sampled_prompt_count(rows, config.data.train_limit)


def coverage_series(run_dir: Path, num_queries: int) -> dict[int, tuple[float, float]]:
    """``{step: (accepted coverage, trained coverage)}``, cumulative over the anchor files."""
    accepted: set[str] = set()
    kept: set[str] = set()
    out = {}
    for step in anchor_file_steps(run_dir):
        for row in read_anchor_file(run_dir, step):
            if row.get("type") == "query" and row.get("reason") == "accepted":
                accepted.add(row["query_id"])
                if row.get("kept"):
                    kept.add(row["query_id"])
        out[step] = (len(accepted) / num_queries, len(kept) / num_queries)
    return out


@dataclass
class RunSeries:
    """One run: ``{curve name: {step: value}}``, its reset steps, the metric key of each
    training curve."""

    series: dict[str, dict[int, float]]
    resets: list[int]
    sources: dict[str, str]


def _values(records: list[dict], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in records if r.get(key) is not None}


def read_run(run_dir: Path, num_queries: int) -> RunSeries:
    """The validation, training and coverage curves of one run directory."""
    records = list(last_per_step(read_metrics(run_dir)).values())
    series = {key: _values(records, key) for key in validation_keys(records)}
    sources = {}
    for name, keys in TRAINING_KEYS.items():
        key = next((k for k in keys if any(k in r for r in records)), None)
        if key is not None:
            series[name], sources[name] = _values(records, key), key
    coverage = coverage_series(run_dir, num_queries)
    series["coverage_accepted"] = {s: c[0] for s, c in coverage.items()}
    series["coverage_trained"] = {s: c[1] for s, c in coverage.items()}
    return RunSeries(series, reset_steps(records), sources)


def collect_variant(spec: CompareSpec, variant: str) -> Curves | None:
    """Stack the curves of every seed of ``variant`` that logged a step, on the union of their
    steps (``None`` when no seed has started)."""
    runs = [r for r in spec.runs_of(variant) if read_metrics(r.run_dir)]
    if not runs:
        return None
    num_queries = count_train_queries(run_config(runs[0]))
    per_seed = [read_run(run.run_dir, num_queries) for run in runs]
    curves = Curves(seeds=[r.seed for r in runs],
                    finished=[run_status(r, run_config(r).run.steps) == "done" for r in runs])  # fmt: skip
    for name in sorted({k for run in per_seed for k in run.series}):
        steps = sorted({s for run in per_seed for s in run.series.get(name, {})})
        curves.steps[name] = np.array(steps, dtype=np.int64)
        curves.values[name] = np.array(
            [[run.series.get(name, {}).get(s, np.nan) for s in steps] for run in per_seed]
        )
    for run in reversed(per_seed):
        curves.sources.update(run.sources)
    curves.resets = sorted({s for run in per_seed for s in run.resets})
    return curves
