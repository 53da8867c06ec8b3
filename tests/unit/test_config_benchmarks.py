"""Validation files and the metrics keep-best and the over-optimization detector read.

Tier: unit (config only; the input check writes small files to ``tmp_path``).
"""

from __future__ import annotations

import pandas as pd
import pytest

from megatron_armor.config import ConfigError, load_config
from megatron_armor.config.benchmarks import logged_metrics
from megatron_armor.config.inputs import check_inputs

pytestmark = pytest.mark.unit

VAL = ["validation.every=10", "validation.n_samples=32"]


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*VAL, *overrides])
    return str(info.value)


def test_a_watched_metric_without_its_file_is_refused_by_name():
    message = _error(
        "data.val_files=[data/aime24.parquet,data/amc.parquet]",
        "run.keep_best.metric=val/amc23/avg@k",
    )
    assert "run.keep_best.metric='val/amc23/avg@k' reads benchmark 'amc23'" in message
    assert "is named amc23" in message and "`armor data amc23`" in message
    assert "val/{aime24,amc}/" in message


def test_the_detector_metric_is_checked_too():
    message = _error(
        "data.val_files=[data/aime.parquet]",
        "overopt.enabled=true",
        "overopt.val_metric=val/aime24/avg@k",
    )
    assert "overopt.val_metric='val/aime24/avg@k' reads benchmark 'aime24'" in message


def test_a_metric_of_another_k_is_refused_with_the_logged_names():
    message = _error(
        "data.val_files=[data/aime24.parquet]", "run.keep_best.metric=val/aime24/avg@16"
    )
    assert "matches no metric validation logs (val/aime24/avg@32" in message
    assert "validation.n_samples=32" in message


@pytest.mark.parametrize(
    "metric", ["val/aime24/avg@k", "val/aime24/avg@32", "val/*/avg@k", "val/aime*/pass@k"]
)
def test_metrics_a_file_logs_load(metric):
    files = "data.val_files=[data/aime24.parquet,data/amc23.parquet]"
    config = load_config(None, [*VAL, files, f"run.keep_best.metric={metric}"])
    assert "val/amc23/maj@32" in logged_metrics(config)


def test_two_validation_files_of_one_stem_are_refused_naming_both():
    message = _error("data.val_files=[a/val.parquet,b/val.parquet]")
    assert "'a/val.parquet' and 'b/val.parquet' are both benchmark 'val'" in message


def test_a_missing_watched_file_names_the_metric_and_armor_data(tmp_path):
    present = tmp_path / "aime25.parquet"
    pd.DataFrame([{"problem": "p", "answer": "1"}]).to_parquet(present)
    missing = tmp_path / "aime24.parquet"
    config = load_config(None, [*VAL, f"data.val_files=[{missing},{present}]",
                                "run.keep_best.metric=val/aime24/avg@k"])  # fmt: skip
    problems = list(check_inputs(config))
    expected = (
        f"run.keep_best.metric='val/aime24/avg@k' reads {missing}, which does not exist; "
        f"`armor data aime24 --out {tmp_path}` writes it"
    )
    assert expected in problems
    assert not any(str(present) in p and "does not exist" in p for p in problems)
