"""The rollout backend registry (rollout/backends.py) and the engine protocol's server methods
on an embedded engine. Tier: unit."""

from __future__ import annotations

import pytest

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.rollout.backends import BACKENDS, backend_of, get_backend
from megatron_armor.rollout.torch_engine import TorchEngine

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


def test_backends_answer_what_the_call_sites_ask():
    assert sorted(BACKENDS) == ["sglang", "torch"]
    assert not get_backend("torch").serves_over_http
    assert get_backend("sglang").serves_over_http
    assert backend_of(ArmorConfig()).name == ArmorConfig().rollout.backend
    with pytest.raises(ValueError, match=r"rollout.backend='vllm'.*\['sglang', 'torch'\]"):
        get_backend("vllm")


def test_the_torch_builder_makes_an_engine_without_servers(tiny_qwen2, tmp_path):
    config = ArmorConfig()
    config.trainer.model_path = tiny_qwen2(tmp_path / "m")
    engine = get_backend("torch").build(config, "cpu", "policy", None)
    assert isinstance(engine, TorchEngine)
    assert list(engine.servers) == [] and engine.api_key == ""
    assert engine.has_weights("policy") and not engine.has_weights("ref")
    with pytest.raises(NotImplementedError, match="TorchEngine.restart_server.*no servers"):
        engine.restart_server(None)
    engine.close()
