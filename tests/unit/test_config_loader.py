"""YAML loading: ``base:`` inheritance, dotted overrides, unknown keys, saving. Tier: unit."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_armor.config import ConfigError, load_config, save_config, to_yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def child(tmp_path):
    _write(
        tmp_path / "base" / "parent.yaml",
        "rollout:\n  batch: 4\n  gen_batch: 12\ntrainer:\n  ppo_mini_batch: 2\nalgo:\n  ref_n: 2\n",
    )
    return _write(
        tmp_path / "child.yaml", "base: base/parent.yaml\nalgo:\n  alpha: 0.875\n  ref_n: 3\n"
    )


def test_base_inheritance_and_overrides(child):
    cfg = load_config(child)
    assert (cfg.rollout.batch, cfg.rollout.gen_batch, cfg.trainer.ppo_mini_batch) == (4, 12, 2)
    assert cfg.algo.alpha == 0.875 and cfg.algo.ref_n == 3  # child wins over parent
    cfg = load_config(child, ["algo.ref_n=5", "rollout.batch=2"])
    assert cfg.algo.ref_n == 5 and cfg.rollout.batch == 2  # overrides win over files
    assert cfg.algo.group_size == 16  # schema default where no file sets it


def test_unknown_key_names_the_file(tmp_path, child):
    bad = _write(tmp_path / "typo.yaml", "base: child.yaml\nalgo:\n  alpah: 0.5\n")
    with pytest.raises(ConfigError, match=rf"{bad}: unknown key `algo.alpah`"):
        load_config(bad)
    _write(tmp_path / "base" / "parent.yaml", "rollut:\n  batch: 4\n")
    with pytest.raises(ConfigError, match=r"parent.yaml: unknown key `rollut`"):
        load_config(child)


def test_bad_overrides(child):
    with pytest.raises(ConfigError, match=r"override 'algo.nope=1': unknown key `algo.nope`"):
        load_config(child, ["algo.nope=1"])
    with pytest.raises(
        ConfigError, match=r"override 'algo.group_size=many': bad value for `algo.group_size`"
    ):
        load_config(child, ["algo.group_size=many"])
    with pytest.raises(ConfigError, match=r"must look like `section.key=value`"):
        load_config(child, ["algo.alpha"])


def test_validation_errors_name_the_file(child):
    with pytest.raises(ConfigError, match=rf"{child}: algo.group_size=1: must be >= 2"):
        load_config(child, ["algo.group_size=1"])


def test_base_errors(tmp_path):
    missing = _write(tmp_path / "a.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml does not exist"):
        load_config(missing)
    two = _write(tmp_path / "b.yaml", "base: [x.yaml, y.yaml]\n")
    with pytest.raises(ConfigError, match="`base:` must be one file path"):
        load_config(two)
    _write(tmp_path / "c.yaml", "base: d.yaml\n")
    loop = _write(tmp_path / "d.yaml", "base: c.yaml\n")
    with pytest.raises(ConfigError, match=r"d.yaml: `base:` cycle: d.yaml -> c.yaml -> d.yaml"):
        load_config(loop)
    for i in range(10):  # a chain without a cycle, too long to be meant
        _write(tmp_path / f"chain{i}.yaml", f"base: chain{i + 1}.yaml\n")
    with pytest.raises(ConfigError, match=r"deeper than 8 files: chain0.yaml -> chain1.yaml"):
        load_config(tmp_path / "chain0.yaml")
    scalar = _write(tmp_path / "e.yaml", "- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)


def test_save_and_reload_round_trip(tmp_path, child):
    cfg = load_config(child, ["algo.reset.schedule=every", "algo.reset.every=3"])
    path = save_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(path)
    assert again.resolved == cfg.resolved  # the file holds the numbers of cfg's ``auto``
    assert to_yaml(again) == to_yaml(cfg)


RUN_CONFIGS = [
    p for p in sorted((REPO / "configs").glob("**/*.yaml")) if p.parent.name != "compare"
]


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_repository_configs_are_valid(path):
    """Run configs, and pipeline files with both their stages (configs/compare/ holds
    `armor compare` specs, tested with them)."""
    from megatron_armor.config.pipeline import is_pipeline_file, load_pipeline

    if is_pipeline_file(path):
        load_pipeline(path)
    else:
        load_config(path)
