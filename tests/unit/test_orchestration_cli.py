"""Unit tier: ``armor train`` / ``armor plot`` argument handling (no Ray, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_armor.cli import build_parser, main
from megatron_armor.observability.metrics import MetricsLogger

pytestmark = pytest.mark.unit
TINY_CPU = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


def test_train_parses_overrides_and_resume():
    args = build_parser().parse_args(["train", TINY_CPU, "run.steps=3", "--resume", "none"])
    assert args.overrides == ["run.steps=3"] and args.resume == "none"
    assert build_parser().parse_args(["train", "x.yaml"]).resume is None  # -> run.resume


def test_train_bad_override_is_exit_2(capsys):
    assert main(["train", TINY_CPU, "algo.nonsense=1"]) == 2
    assert "unknown key" in capsys.readouterr().err


def test_plot_writes_pngs(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2):
        logger.log(step, {"reward/policy_mean": 0.1 * step, "kl/reverse_k3": 0.01})
    assert main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reward_vs_val.png" in out and "kl.png" in out
    assert main(["plot", str(tmp_path / "missing")]) == 2
