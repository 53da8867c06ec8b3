"""Model provider: an HF ``config.json`` -> megatron-core ``GPTModel`` (docs/trainer.md).

Supported architectures: Qwen2 / Qwen2.5 (qkv bias), Qwen3 (qk layernorm, explicit head_dim),
Qwen3-MoE (Qwen3 attention, mixture-of-experts MLPs: ``moe.py``), Llama 3 (``llama3`` rope
scaling); tied or untied embeddings. The vocabulary is padded to a
multiple of ``VOCAB_PAD_MULTIPLE * tp``; the padded logits are masked out of every
log-prob (``logprobs.py``). The layer spec is Transformer Engine's when
``transformer_impl == "te"`` (TE must import), the megatron-core local spec otherwise.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_armor.config.inputs import SUPPORTED_ARCHITECTURES
from megatron_armor.config.model_overrides import merged_hf_config
from megatron_armor.config.moe import MoEShape, moe_shape
from megatron_armor.config.schema import FP8Config, TrainerConfig
from megatron_armor.trainer import parallel, routing_replay
from megatron_armor.trainer.moe import moe_block_spec, moe_config_fields

VOCAB_PAD_MULTIPLE = 128
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class HFModelSpec:
    """The architecture facts read from an HF ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoEShape | None = None
    """Experts and routing of a mixture-of-experts model (``None``: dense)."""

    def padded_vocab(self, tp: int) -> int:
        """``V`` rounded up to a multiple of ``VOCAB_PAD_MULTIPLE * tp``."""
        multiple = VOCAB_PAD_MULTIPLE * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """``(theta, scaling)`` from either the transformers-4 (``rope_theta``/``rope_scaling``) or
    the transformers-5 (``rope_parameters``) layout."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(
            f"rope scaling type {kind!r} in config.json is not supported; supported: "
            f"default, llama3 (Llama 3.1+). Use a model with one of those"
        )
    return theta, dict(scaling)


def read_hf_spec(model_dir: str, overrides: dict | None = None) -> HFModelSpec:
    """Parse ``model_dir/config.json`` with ``overrides`` (``trainer.model_overrides``) on top,
    resolved as the engines get them (``config/model_overrides.py``: a RoPE override replaces
    the model's base in either config layout); raises for unsupported architectures."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = merged_hf_config(json.load(f), overrides or {})
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"trainer.model_path={model_dir!r} has model_type={model_type!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope_settings(cfg)
    return HFModelSpec(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_positions=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=moe_shape(cfg),
    )


def fp8_settings(fp8: FP8Config) -> dict:
    """Map ``trainer.fp8`` onto ``TransformerConfig`` fields (Transformer Engine must import:
    ``config/validate.py`` ``check_runtime``)."""
    if not fp8.enabled:
        return {}
    return {
        "fp8": fp8.format,
        "fp8_recipe": fp8.recipe,
        "fp8_margin": fp8.margin,
        "fp8_amax_history_len": fp8.amax_history_len,
        "fp8_amax_compute_algo": fp8.amax_compute_algo,
    }


def grad_accum_fusion_available() -> bool:
    """Whether megatron-core's ``ColumnParallelLinear`` (the output layer, also under the TE
    spec) can fuse the weight-gradient accumulation: it needs APEX's
    ``fused_weight_gradient_mlp_cuda`` extension and raises at build time without it."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def fusion_settings(transformer_impl: str, cuda: bool) -> dict:
    """megatron-core's kernel fusions: on with CUDA and the Transformer Engine spec (fused
    RoPE, also for ``thd`` packed sequences, where the unfused path splits every sample on
    the host in every layer; bias-SwiGLU, bias-dropout, softmax, layer norm), the
    gradient-accumulation fusion where its extension is present
    (:func:`grad_accum_fusion_available`); all off on CPU and with the local spec, whose
    numbers the CPU tests compare bit for bit."""
    fused = cuda and transformer_impl == "te"
    return {
        "bias_activation_fusion": fused,
        "bias_dropout_fusion": fused,
        "masked_softmax_fusion": fused,
        "apply_rope_fusion": fused,
        "persist_layer_norm": fused,
        "gradient_accumulation_fusion": fused and grad_accum_fusion_available(),
    }


def build_transformer_config(spec: HFModelSpec, trainer: TrainerConfig) -> TransformerConfig:
    """The megatron-core ``TransformerConfig`` for ``spec`` under ``trainer``'s layout/precision
    (a loaded, valid config: ``config/validate.py``)."""
    dtype = _DTYPES[trainer.precision]
    cpu = not torch.cuda.is_available()
    recompute = (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        if trainer.recompute
        else {}
    )
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tp_size(),
        pipeline_model_parallel_size=parallel.pp_size(),
        context_parallel_size=trainer.cp,
        sequence_parallel=trainer.sequence_parallel,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # dense models; "allgather" rejects variable lengths
        use_cpu_initialization=cpu,
        **fusion_settings(trainer.transformer_impl, cuda=not cpu),
        **recompute,
        **fp8_settings(trainer.fp8),
        **(moe_config_fields(spec.moe, trainer) if spec.moe is not None else {}),
    )


def layer_spec(spec: HFModelSpec, transformer_impl: str):
    """TE layer spec for ``te`` (TE must import: ``config/validate.py`` ``check_runtime``),
    megatron-core's local spec for ``local``."""
    if transformer_impl == "te":
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    return get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")


def rope_inv_freq(spec: HFModelSpec) -> torch.Tensor:
    """``inv_freq[i] = theta^(-2i/d)``, with Llama-3 frequency scaling when configured
    (the same formula as transformers' ``_compute_llama3_parameters``)."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if spec.rope_scaling is None:
        return inv
    s = spec.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def build_model(spec: HFModelSpec, trainer: TrainerConfig) -> GPTModel:
    """This rank's ``GPTModel`` stage (parameters uninitialised; load weights next)."""
    config = build_transformer_config(spec, trainer)
    blocks = (
        layer_spec(spec, trainer.transformer_impl)
        if spec.moe is None
        else moe_block_spec(config, trainer.transformer_impl)
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=blocks,
        vocab_size=spec.padded_vocab(parallel.tp_size()),
        max_sequence_length=spec.max_positions,
        pre_process=parallel.is_first_stage(),
        post_process=parallel.is_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
    )
    model.rotary_pos_emb.inv_freq = rope_inv_freq(spec).to(model.rotary_pos_emb.inv_freq.device)
    if spec.moe is not None:
        routing_replay.install(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
