"""``armor tiny``: the tiny task's data, a warm-started tiny model, and their accuracy.

Layout of ``out_dir``::

    data/train.parquet   levels 1-3, DAPO-Math schema (data_source "tiny_arith")
    data/val.parquet     levels 2-4 (harder)
    model/               HF Qwen2 (or Qwen3-MoE) directory: config.json, model.safetensors, ...
    tiny.json            the completion marker: settings, warm-start summary, accuracies

``tiny.json`` is written last, so its presence means the directory is complete; a rerun
skips the work unless ``force``. Everything is deterministic in ``seed``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_armor.tiny.accuracy import measure_accuracy
from megatron_armor.tiny.model import TinyModelConfig, build_model, save_model_dir
from megatron_armor.tiny.task import generate_problems, task_levels, write_task
from megatron_armor.tiny.tokenizer import build_tokenizer
from megatron_armor.tiny.warmstart import WarmStartConfig, warm_start

MARKER = "tiny.json"
REPORT_PROBLEMS = 256
"""Problems of each split sampled for the reported accuracy."""


@dataclass(frozen=True)
class TinyBuildConfig:
    """Everything ``armor tiny`` makes, and how."""

    n_train: int = 2048
    """Rows of ``train.parquet``."""
    n_val: int = 256
    """Rows of ``val.parquet``."""
    seed: int = 0
    """Data seed (train uses ``seed``, val ``seed + 1``)."""
    task: str = "arith"
    """``arith`` | ``long_tail`` (``tiny.task.TASKS``): the levels of the splits and of the
    warm start."""
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Model shape and init seed."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Warm-start settings (stops at ``target_accuracy``)."""


def paths(out_dir: str | Path) -> dict[str, Path]:
    """Where each artifact of ``out_dir`` lives."""
    out = Path(out_dir)
    return {
        "model": out / "model",
        "train": out / "data" / "train.parquet",
        "val": out / "data" / "val.parquet",
        "marker": out / MARKER,
    }


def read_marker(out_dir: str | Path) -> dict[str, Any] | None:
    """The completion record of ``out_dir``, or ``None`` when it is not complete."""
    marker = paths(out_dir)["marker"]
    return json.loads(marker.read_text()) if marker.is_file() else None


def clear(out_dir: str | Path) -> None:
    """Remove what a previous (possibly interrupted) build left in ``out_dir``."""
    p = paths(out_dir)
    p["marker"].unlink(missing_ok=True)
    shutil.rmtree(p["model"], ignore_errors=True)
    shutil.rmtree(p["train"].parent, ignore_errors=True)


def split_accuracy(model, tokenizer, cfg: TinyBuildConfig) -> dict[str, dict[str, Any]]:
    """Sampled (T = 1.0) and greedy accuracy on the first problems of each written split."""
    train_levels, val_levels = task_levels(cfg.task)
    splits = {
        "train": generate_problems(min(cfg.n_train, REPORT_PROBLEMS), cfg.seed, train_levels),
        "val": generate_problems(min(cfg.n_val, REPORT_PROBLEMS), cfg.seed + 1, val_levels),
    }
    report: dict[str, dict[str, Any]] = {}
    for name, problems in splits.items():
        for label, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            r = measure_accuracy(model, tokenizer, problems, temperature=temperature)
            report[f"{name}_{label}"] = {
                "accuracy": r.accuracy,
                "by_level": {str(k): v for k, v in sorted(r.by_level.items())},
                "summary": r.summary(),
            }
    return report


def build_tiny(
    out_dir: str | Path, cfg: TinyBuildConfig | None = None, force: bool = False
) -> dict:
    """Make data + warm-started model in ``out_dir``; returns the marker record.

    When ``out_dir`` is already complete (marker present) and not ``force``, nothing is
    done and the existing record is returned with ``"skipped": True``.
    """
    cfg = cfg or TinyBuildConfig()
    existing = read_marker(out_dir)
    if existing is not None and not force:
        return {**existing, "skipped": True}
    clear(out_dir)
    start = time.perf_counter()
    p = paths(out_dir)
    write_task(p["train"].parent, cfg.n_train, cfg.n_val, cfg.seed, cfg.task)
    tokenizer = build_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.warm_start.num_threads)
    try:
        model = build_model(cfg.model)
        result = warm_start(model, tokenizer, cfg.warm_start, task_levels(cfg.task)[0])
        save_model_dir(model, p["model"])
        accuracy = split_accuracy(model, tokenizer, cfg)
    finally:
        torch.set_num_threads(threads)
    record = {
        "config": asdict(cfg),
        "warm_start": asdict(result),
        "accuracy": accuracy,
        "paths": {k: str(v) for k, v in p.items() if k != "marker"},
    }
    record["seconds"] = round(time.perf_counter() - start, 1)
    p["marker"].write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "skipped": False}
