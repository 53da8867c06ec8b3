"""Config's trait tables (config/rollout_traits.py) and rollout's builders name the same
backends and reference strategies, each builder carrying config's traits. Tier: unit.

Validation reads only the traits (config never imports rollout); a name added on one side
alone would be accepted by the config and fail at build time, or be built but refused.
"""

from __future__ import annotations

import pytest

from megatron_armor.config.rollout_traits import (
    BACKEND_TRAITS,
    REFERENCE_TRAITS,
    STRATEGIES,
    backend_traits,
)
from megatron_armor.config.validate import rollout_choices
from megatron_armor.rollout.backends import BACKENDS
from megatron_armor.rollout.reference import REFERENCE_STRATEGIES

pytestmark = pytest.mark.unit


def test_every_backend_has_traits_and_a_builder():
    assert set(BACKENDS) == set(BACKEND_TRAITS)
    for name, backend in BACKENDS.items():
        assert backend.traits is BACKEND_TRAITS[name]
        assert backend.name == name and callable(backend.build)


def test_every_reference_strategy_has_traits_and_a_builder():
    assert set(REFERENCE_STRATEGIES) == set(REFERENCE_TRAITS)
    for name, strategy in REFERENCE_STRATEGIES.items():
        assert strategy.traits is REFERENCE_TRAITS[name]
        assert strategy.traits.name == name and callable(strategy.build)
        assert strategy.traits.fill in REFERENCE_TRAITS  # a strategy draws fresh samples


def test_validation_accepts_exactly_the_built_names():
    choices = rollout_choices()
    assert set(choices["rollout.backend"]) == set(BACKENDS)
    assert set(choices["rollout.ref_strategy"]) == set(REFERENCE_STRATEGIES) - {"none"}
    assert set(STRATEGIES) == set(choices["rollout.ref_strategy"])
    with pytest.raises(ValueError, match=r"rollout.backend='vllm'.*\['sglang', 'torch'\]"):
        backend_traits("vllm")
