"""Validation benchmarks and the metrics named after them.

Each file of ``data.val_files`` is one benchmark named by its file stem (``data/aime24.parquet``
-> ``aime24``), and validation logs ``val/<name>/avg@<k>``, ``pass@<k>``, ``maj@<k>`` and
``val/<name>/n`` (``k = validation.n_samples``). ``run.keep_best`` and the over-optimization
detector read those metrics by name, so a file named otherwise (``amc.parquet`` for a metric
``val/amc23/...``) would leave them without a value for the whole run: the detector never
fires, no best checkpoint is kept. The rules here refuse that at load, and two files of the
same stem (their metrics would mix).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Iterator
from pathlib import Path

from megatron_armor.config.schema import ArmorConfig

Problems = Iterator[str]

METRIC_KEYS = ("avg@k", "pass@k", "maj@k", "n")
"""What validation logs per benchmark (``evaluation/runner.py``); ``@k`` = ``@<n_samples>``."""


def benchmark_name(file: str) -> str:
    """The benchmark a validation file is: its stem (the ``<name>`` of ``val/<name>/...``)."""
    return Path(file).stem


def logged_metrics(config: ArmorConfig) -> list[str]:
    """Every ``val/...`` metric a run of ``config`` logs."""
    k = f"@{config.validation.n_samples}"
    names = [benchmark_name(f) for f in config.data.val_files]
    return [f"val/{n}/{key.replace('@k', k)}" for n in names for key in METRIC_KEYS]


def watched_metrics(config: ArmorConfig) -> list[tuple[str, str]]:
    """``(setting, metric)`` of the validation metrics keep-best and the detector read."""
    best, overopt = config.run.keep_best, config.overopt
    watched = [("run.keep_best.metric", best.metric)] if best.metric else []
    if overopt.enabled:
        watched.append(("overopt.val_metric", overopt.val_metric))
    return [(key, metric) for key, metric in watched if metric.startswith("val/")]


def check_benchmark_names(config: ArmorConfig) -> Problems:
    """Two validation files with one stem would log into the same metrics."""
    seen: dict[str, str] = {}
    for file in config.data.val_files:
        name = benchmark_name(file)
        if name in seen:
            yield (
                f"data.val_files: {seen[name]!r} and {file!r} are both benchmark {name!r} (a file's "
                f"stem names its metrics, val/{name}/...); rename one of them"
            )
        seen.setdefault(name, file)


def check_watched_metrics(config: ArmorConfig) -> Problems:
    """Each metric keep-best or the detector reads is one a validation file logs."""
    if config.validation.every <= 0:
        return  # check_watchers (validate.py) asks for validation first
    logged = logged_metrics(config)
    for key, metric in watched_metrics(config):
        resolved = metric.replace("@k", f"@{config.validation.n_samples}")
        if not any(fnmatch.fnmatchcase(name, resolved) for name in logged):
            yield _unlogged(config, key, metric, logged)


def _unlogged(config: ArmorConfig, key: str, metric: str, logged: list[str]) -> str:
    """The problem of a watched metric no validation file logs, with the fix."""
    names = [benchmark_name(f) for f in config.data.val_files]
    wanted = metric.split("/")[1] if metric.count("/") >= 2 else ""
    k = config.validation.n_samples
    if wanted and "*" not in wanted and wanted not in names:
        return (
            f"{key}={metric!r} reads benchmark {wanted!r}, but no file of data.val_files "
            f"{config.data.val_files} is named {wanted} (a file's stem names its metrics: "
            f"data/{wanted}.parquet logs val/{wanted}/...); add or rename that file (`armor data "
            f"{wanted}` writes the paper's benchmarks) or watch one of val/{{{','.join(names)}}}/"
        )
    return (
        f"{key}={metric!r} matches no metric validation logs ({', '.join(logged[:4])}, ...: "
        f"avg/pass/maj@{k} and n per benchmark, validation.n_samples={k}); write @k for the "
        "run's k, or a benchmark of data.val_files"
    )


def missing_watched_files(config: ArmorConfig, preparable: Collection[str]) -> Problems:
    """A validation file a watched metric reads that does not exist here (the input check of
    ``armor train``): named with the metric and, for a benchmark ``armor data`` writes (one of
    ``preparable``), that command."""
    if config.validation.every <= 0:
        return
    k = f"@{config.validation.n_samples}"
    for key, metric in watched_metrics(config):
        resolved = metric.replace("@k", k)
        for file in config.data.val_files:
            name = benchmark_name(file)
            reads = any(fnmatch.fnmatchcase(f"val/{name}/{m.replace('@k', k)}", resolved)
                        for m in METRIC_KEYS)  # fmt: skip
            if reads and _is_local(file) and not Path(file).expanduser().exists():
                fix = (
                    f"`armor data {name} --out {Path(file).parent}` writes it"
                    if name in preparable and Path(file).suffix == ".parquet"
                    else "create it or point data.val_files at it"
                )
                yield f"{key}={metric!r} reads {file}, which does not exist; {fix}"


def _is_local(file: str) -> bool:
    """Not a hub name (``owner/name[:split]``, read where a network exists)."""
    return Path(file).suffix.lower() in (".parquet", ".jsonl", ".json") or file.startswith(
        (".", "/", "~")
    )
