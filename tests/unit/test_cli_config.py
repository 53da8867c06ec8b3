"""``armor config show FILE [overrides]`` (in-process and as ``python -m``). Tier: unit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatron_armor.cli import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def child(tmp_path):
    (tmp_path / "parent.yaml").write_text(
        "rollout:\n  batch: 4\n  gen_batch: 8\ntrainer:\n  ppo_mini_batch: 2\n"
    )
    child = tmp_path / "child.yaml"
    child.write_text("base: parent.yaml\nalgo:\n  alpha: 0.875\n")
    return child


def test_show_prints_resolved_config(child, capsys):
    assert main(["config", "show", str(child), "algo.ref_n=2", "algo.ratio=off_policy"]) == 0
    shown = OmegaConf.create(capsys.readouterr().out)
    assert shown.algo.alpha == 0.875 and shown.algo.ref_n == 2 and shown.algo.ratio == "off_policy"
    assert shown.rollout.batch == 4 and shown.rollout.gen_batch == 8  # from the base file
    assert "base" not in shown


def test_show_bad_override_exits_2(child, capsys):
    assert main(["config", "show", str(child), "rollout.gen_batch=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("armor config: ")
    assert "rollout.gen_batch=2: must be >= rollout.batch=4" in err


def test_show_unknown_key_exits_2(child, capsys):
    assert main(["config", "show", str(child), "algo.alhpa=0.5"]) == 2
    assert "override 'algo.alhpa=0.5': unknown key `algo.alhpa`" in capsys.readouterr().err


def test_python_dash_m_entry_point(child):
    """The real entry point (one subprocess: imports torch, ~2 s)."""
    cmd = [
        sys.executable,
        "-m",
        "megatron_armor.cli",
        "config",
        "show",
        str(child),
        "algo.group_size=8",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    shown = OmegaConf.create(out.stdout)
    assert shown.algo.group_size == 8 and shown.rollout.batch == 4


def test_check_reports_each_file(child, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: child.yaml\nalgo:\n  group_size: 1\n")
    assert main(["config", "check", str(child)]) == 0
    assert capsys.readouterr().out == f"ok {child}\n"
    assert main(["config", "check", str(child), str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == f"ok {child}\n"
    assert f"{bad}: algo.group_size=1: must be >= 2" in captured.err
