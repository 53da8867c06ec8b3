"""Unit tier: reading HF configs, rope frequencies, FP8/TE settings errors, CPU-mode checks."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from megatron_armor.config.schema import ArmorConfig, FP8Config, TrainerConfig
from megatron_armor.config.validate import find_problems, validate_runtime
from megatron_armor.trainer import cpu_compat
from megatron_armor.trainer.model import (
    fp8_settings,
    fusion_settings,
    grad_accum_fusion_available,
    read_hf_spec,
    rope_inv_freq,
)

pytestmark = pytest.mark.unit


def write_config(tmp_path, **overrides) -> str:
    cfg = {
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_reads_both_rope_layouts(tmp_path) -> None:
    v4 = read_hf_spec(write_config(tmp_path, rope_theta=5e5))
    assert v4.rope_theta == 5e5 and v4.rope_scaling is None and v4.head_dim == 16
    v5 = read_hf_spec(
        write_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    )
    assert v5.rope_theta == 1e6
    assert v5.padded_vocab(1) == 384 and v5.padded_vocab(2) == 512


def test_unsupported_model_and_rope_type_are_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        read_hf_spec(write_config(tmp_path, model_type="gpt2"))
    with pytest.raises(ValueError, match="yarn"):
        read_hf_spec(write_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_llama3_rope_scaling_matches_transformers(tmp_path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    spec = read_hf_spec(write_config(tmp_path, rope_theta=5e5, rope_scaling=scaling))
    hf_cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_theta=5e5, rope_scaling=scaling
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(spec), expected)
    plain = 1.0 / (5e5 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(rope_inv_freq(spec), plain)
    assert math.isclose(rope_inv_freq(spec)[0].item(), 1.0)


def test_transformer_engine_is_required_by_the_runtime_check() -> None:
    assert fp8_settings(FP8Config(enabled=False)) == {}
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU build, where Transformer Engine cannot import")
    config = ArmorConfig()
    config.trainer.transformer_impl, config.trainer.fp8.enabled = "te", True
    assert find_problems(config) == []  # a valid config; this machine lacks the software
    with pytest.raises(ValueError, match="trainer.transformer_impl='te': Transformer Engine"):
        validate_runtime(config)
    config.orchestration.layout = "cpu"  # armor train on the trainer's own machine
    assert any("Transformer Engine" in p for p in find_problems(config, inputs=True))
    config.trainer.transformer_impl = "fast"
    assert any(p.startswith("trainer.transformer_impl='fast'") for p in find_problems(config))


def test_cpu_mode_checks_the_megatron_version(monkeypatch) -> None:
    from megatron.core import package_info

    cpu_compat.check_megatron_version()
    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="verified with megatron-core 0.16.1"):
        cpu_compat.check_megatron_version()


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"cp": 2}, "trainer.cp=2: context parallelism is not implemented"),
        ({"vpp": 2}, "trainer.vpp=2: virtual pipeline stages"),
        ({"sequence_parallel": True}, "needs trainer.tp > 1"),
    ],
)
def test_layouts_the_trainer_does_not_implement_fail_at_load(overrides, match) -> None:
    config = ArmorConfig(trainer=TrainerConfig(**overrides, world_size=4))
    assert any(match in p for p in find_problems(config))


def test_sequence_parallelism_with_the_local_spec_needs_apex() -> None:
    if importlib.util.find_spec("apex") is not None:
        pytest.skip("Apex is installed: sequence parallelism works with the local spec")
    config = ArmorConfig(trainer=TrainerConfig(sequence_parallel=True, tp=2, world_size=2))
    with pytest.raises(ValueError, match="needs Apex"):
        validate_runtime(config)


@pytest.mark.parametrize(("tp", "sp", "fp8", "multiple"), [
    (1, False, False, 1), (4, True, False, 4), (1, False, True, 16), (4, False, True, 16),
    (2, True, True, 32), (4, True, True, 64), (8, True, True, 128),
])  # fmt: skip
def test_fp8_token_padding_keeps_each_local_shard_a_multiple_of_16(tp, sp, fp8, multiple) -> None:
    """TE asserts an FP8 GEMM input's rows divisible by 8; with sequence parallelism a rank holds
    ``T / tp`` rows (``lcm(tp, 16)`` gave ``T / 4`` rows in multiples of 4 at ``tp = 4``)."""
    from megatron_armor.trainer.batching import token_multiple

    assert token_multiple(tp, sp, fp8) == multiple
    if fp8:
        assert (multiple // (tp if sp else 1)) % 8 == 0


def test_mxfp8_is_refused_on_a_gpu_older_than_blackwell(monkeypatch) -> None:
    config = ArmorConfig()
    config.trainer.fp8 = FP8Config(enabled=True, recipe="mxfp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    from megatron_armor.config.validate import check_fp8_recipe_hardware

    (problem,) = check_fp8_recipe_hardware(config)
    assert "mxfp8" in problem and "H100" in problem and "9.0" in problem
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert list(check_fp8_recipe_hardware(config)) == []
    config.trainer.fp8.recipe = "delayed"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert list(check_fp8_recipe_hardware(config)) == []


def test_reads_qwen3_moe_layers_and_routing(tmp_path) -> None:
    """Sparse layers as transformers builds them (``decoder_sparse_step``, ``mlp_only_layers``),
    the expert count under either name, routing onto megatron-core's router settings, and the
    HF tensors the weights check then expects."""
    from megatron_armor.config.weights_check import expected_shapes
    from megatron_armor.trainer.moe import moe_config_fields

    moe = dict(model_type="qwen3_moe", num_hidden_layers=4, moe_intermediate_size=8,
               num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
               head_dim=16)  # fmt: skip
    spec = read_hf_spec(write_config(tmp_path, **moe, num_experts=4, norm_topk_prob=True))
    assert spec.qk_norm and spec.moe is not None
    assert spec.moe.sparse_layers == (False, True, False, False)
    assert spec.moe.layer_pattern == [0, 1, 0, 0]
    assert (spec.moe.num_experts, spec.moe.topk, spec.moe.expert_ffn) == (4, 2, 8)
    fields = moe_config_fields(spec.moe, TrainerConfig())
    assert fields["moe_router_pre_softmax"] is False  # renormalised top-k: softmax over top-k
    assert (
        fields["moe_router_dtype"] == "fp32" and fields["moe_router_load_balancing_type"] == "none"
    )
    saved = read_hf_spec(write_config(tmp_path, **moe, num_local_experts=6, norm_topk_prob=False))
    assert saved.moe.num_experts == 6
    assert moe_config_fields(saved.moe, TrainerConfig())["moe_router_pre_softmax"] is True
    shapes = expected_shapes(json.loads((tmp_path / "config.json").read_text()))
    assert shapes["model.layers.1.mlp.gate.weight"] == [6, 64]
    assert shapes["model.layers.1.mlp.experts.5.down_proj.weight"] == [64, 8]
    assert "model.layers.1.mlp.gate_proj.weight" not in shapes
    assert shapes["model.layers.3.mlp.gate_proj.weight"] == [96, 64]
    assert read_hf_spec(write_config(tmp_path)).moe is None


def test_fusions_are_on_with_cuda_and_transformer_engine_and_off_on_cpu() -> None:
    """``auto``: the CPU path (and the local spec) keeps the unfused kernels it is tested with;
    a TE run on a GPU fuses RoPE (no per-sample host split of packed sequences), bias-SwiGLU,
    dropout, softmax and norms; weight-gradient accumulation only with APEX's extension."""
    off = fusion_settings("te", cuda=False)
    assert set(off.values()) == {False}
    assert set(fusion_settings("local", cuda=True).values()) == {False}
    on = fusion_settings("te", cuda=True)
    assert on["apply_rope_fusion"] and on["bias_activation_fusion"] and on["masked_softmax_fusion"]
    assert on["gradient_accumulation_fusion"] == grad_accum_fusion_available()
