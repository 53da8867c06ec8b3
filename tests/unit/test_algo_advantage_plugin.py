"""An advantage estimator added by registration alone, with its own hyperparameter set through
``algo.advantage_args`` (docs/architecture.md, where to add X). Tier: unit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_armor.algo import registry
from megatron_armor.algo.advantages import (
    AdvantageEstimator,
    as_group_rows,
    assign_configured_advantages,
)
from megatron_armor.config.loader import load_config
from megatron_armor.config.validate import find_problems
from megatron_armor.types import Group, Sample

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


@dataclass(frozen=True)
class ToyParams:
    """The toy estimator's hyperparameters, checked by the estimator itself."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"algo.advantage_args.scale={self.scale}: use a value > 0")


def toy_advantages(scores: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * (R - mean(R))`` per row."""
    rows = as_group_rows(scores)
    return scale * (rows - rows.mean(-1, keepdim=True))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(
        registry.ADVANTAGES, "toy", AdvantageEstimator(toy_advantages, params=ToyParams)
    )


def groups_of(rewards: list[list[float]]) -> list[Group]:
    out = []
    for q, row in enumerate(rewards):
        samples = [Sample(f"q{q}", [1], [2], score=r) for r in row]
        out.append(Group(query_id=f"q{q}", samples=samples))
    return out


def test_a_registered_estimator_gets_its_own_hyperparameter_from_the_config(toy):
    config = load_config(TINY, ["algo.advantage=toy", "algo.advantage_args.scale=3.0"])
    assert find_problems(config) == []  # the name is valid because the registry has it
    groups = groups_of([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assign_configured_advantages(groups, config.algo)
    assert groups[0].advantages == pytest.approx([1.5, -1.5, -1.5, 1.5])
    assert groups[1].advantages == pytest.approx([2.25, -0.75, -0.75, -0.75])


def test_the_estimator_checks_its_hyperparameters_at_load(toy):
    with pytest.raises(ValueError, match=r"algo.advantage_args.scale=0.*> 0"):
        load_config(TINY, ["algo.advantage=toy", "algo.advantage_args.scale=0"])
    with pytest.raises(ValueError, match=r"\['temperature'\] are not hyperparameters.*'toy'"):
        load_config(TINY, ["algo.advantage=toy", "algo.advantage_args.temperature=2"])
    with pytest.raises(ValueError, match=r"algo.advantage_args=\{'scale': 'big'\}.*types"):
        load_config(TINY, ["algo.advantage=toy", "algo.advantage_args.scale=big"])


def test_an_unknown_argument_of_a_builtin_fails_at_load_naming_the_fix():
    with pytest.raises(ValueError, match=r"\['bogus'\] are not hyperparameters.*'grpo'"):
        load_config(TINY, ["algo.advantage_args.bogus=1"])


def test_builtin_settings_keep_their_keys():
    with pytest.raises(ValueError, match="quantile is set by algo.qae_quantile"):
        load_config(TINY, ["algo.advantage=qae", "algo.advantage_args.quantile=0.3"])
