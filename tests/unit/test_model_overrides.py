"""Unit tier: ``trainer.model_overrides`` resolved once for the trainer, the embedded engine and
the SGLang servers (``config/model_overrides.py``), in both ``config.json`` layouts."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_armor.config.model_overrides import merged_hf_config, resolve_model_overrides
from megatron_armor.rollout.sglang import launch
from megatron_armor.trainer.model import read_hf_spec, rope_inv_freq

pytestmark = pytest.mark.unit
V4 = {"rope_theta": 10000.0}  # transformers 4 (released Qwen2.5 checkpoints)
V5 = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # transformers 5
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.mark.parametrize("layout", [V4, V5, {**V4, **V5}])
def test_a_flat_rope_theta_override_becomes_one_rope_parameters(layout) -> None:
    served = resolve_model_overrides(layout, {"rope_theta": 40000, "max_position_embeddings": 64})
    assert served == {"max_position_embeddings": 64,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 40000.0}}  # fmt: skip


def test_the_models_scaling_survives_and_overrides_merge_in_order() -> None:
    hf = {"rope_theta": 5e5, "rope_scaling": {**LLAMA3, "type": "llama3"}}
    params = resolve_model_overrides(hf, {"rope_theta": 1e6})["rope_parameters"]
    assert params == {**LLAMA3, "rope_theta": 1e6}  # the flat 'type' spelled as rope_type
    both = resolve_model_overrides(V5, {"rope_parameters": {"rope_theta": 2.0}, "rope_theta": 3.0})
    assert both["rope_parameters"]["rope_theta"] == 3.0  # rope_theta is applied last
    assert resolve_model_overrides(V5, {"max_position_embeddings": 8}) == {
        "max_position_embeddings": 8
    }  # no RoPE key: nothing added


@pytest.mark.parametrize("layout", [V4, V5])
def test_the_trainer_reads_the_override_in_both_layouts(tmp_path, layout) -> None:
    """The trainer used to take ``rope_parameters`` before a flat override (a transformers-5
    config kept its own base); now it reads what the servers are sent."""
    cfg = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, **layout}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = read_hf_spec(str(tmp_path), {"rope_theta": 40000})
    assert spec.rope_theta == 40000.0 and spec.rope_scaling is None
    assert merged_hf_config(cfg, {"rope_theta": 40000})["rope_parameters"]["rope_theta"] == 40000
    args = launch.server_args_for(str(tmp_path), 30000, model_overrides={"rope_theta": 40000})
    served = json.loads(args["json_model_override_args"])
    assert served == {"rope_parameters": {"rope_type": "default", "rope_theta": 40000.0}}


def test_the_embedded_engine_serves_the_trainers_rope(tmp_path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_armor.rollout.torch_engine import TorchEngine

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    overrides = {"rope_theta": 40000}
    engine = TorchEngine(str(tmp_path), model_overrides=overrides)
    served = engine._model("policy").model.rotary_emb.inv_freq
    trained = rope_inv_freq(read_hf_spec(str(tmp_path), overrides))
    assert torch.allclose(served, trained, rtol=1e-6)
    plain = TorchEngine(str(tmp_path))._model("policy").model.rotary_emb.inv_freq
    assert not torch.allclose(plain, trained)
