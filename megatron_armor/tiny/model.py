"""Factory for the tiny model directory (HF format, loads offline).

The directory holds ``config.json`` (``model_type: qwen2``, or ``qwen3_moe`` for the
mixture-of-experts variant: ``num_experts > 0``), ``model.safetensors``,
``generation_config.json`` and the character-level tokenizer (:mod:`.tokenizer`). It is the
same layout as a real Qwen2.5 / Qwen3-MoE checkpoint, so the trainer's HF <-> Megatron
conversion and both rollout backends treat it like any other model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from megatron_armor.tiny.tokenizer import build_vocab, write_tokenizer


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny model (defaults: ~0.4 M parameters)."""

    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (head dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads (GQA, as in Qwen2)."""
    intermediate_size: int = 384
    """SwiGLU hidden width."""
    max_position_embeddings: int = 256
    """Longest prompt + response the model is meant for."""
    vocab_multiple: int = 64
    """The embedding table is padded to a multiple of this (Megatron TP needs divisibility)."""
    tie_word_embeddings: bool = False
    """Share input embedding and LM head (False, as in Qwen2.5-7B)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    seed: int = 0
    """Initialization seed."""
    num_experts: int = 0
    """Routed experts per layer; 0 (default): the dense Qwen2 model, > 0: a Qwen3-MoE (q/k
    norm, no qkv bias, every layer sparse) with ``intermediate_size`` unused."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k, probabilities renormalised; MoE only)."""
    moe_intermediate_size: int = 192
    """SwiGLU width of one expert (MoE only: two active experts match the dense width)."""

    def __post_init__(self) -> None:
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"TinyModelConfig: experts_per_token={self.experts_per_token} must lie in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyModelConfig: hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; pick a multiple"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyModelConfig: num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}; pick a divisor"
            )


def padded_vocab_size(vocab: int, multiple: int) -> int:
    """``vocab`` rounded up to a multiple of ``multiple``."""
    return -(-vocab // multiple) * multiple


def shared_fields(cfg: TinyModelConfig) -> dict:
    """The HF config fields both tiny variants share: the tokenizer's vocabulary and special
    tokens, the width, heads, RoPE, RMSNorm, SwiGLU and fp32."""
    vocab = build_vocab()
    return dict(
        vocab_size=padded_vocab_size(len(vocab), cfg.vocab_multiple),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<pad>"],
        torch_dtype="float32",
    )


def qwen2_config(cfg: TinyModelConfig) -> Qwen2Config:
    """The HF ``Qwen2Config`` for ``cfg`` (qkv bias, RMSNorm, SwiGLU, RoPE, as Qwen2)."""
    return Qwen2Config(**shared_fields(cfg), use_sliding_window=False)


def qwen3_moe_config(cfg: TinyModelConfig) -> Qwen3MoeConfig:
    """The HF ``Qwen3MoeConfig`` of the mixture-of-experts variant: Qwen3's attention (q/k
    RMSNorm, no qkv bias), every layer sparse, top-k routing with renormalised probabilities
    (as Qwen3-30B-A3B), the dense model's width, heads, RoPE and tokenizer."""
    return Qwen3MoeConfig(
        **shared_fields(cfg),
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=cfg.hidden_size // cfg.num_heads,
        attention_bias=False,
    )


def build_model(cfg: TinyModelConfig) -> PreTrainedModel:
    """A freshly initialized tiny Qwen2, or Qwen3-MoE when ``cfg.num_experts`` (deterministic
    in ``cfg.seed``)."""
    torch.manual_seed(cfg.seed)
    if cfg.num_experts:
        model = Qwen3MoeForCausalLM(qwen3_moe_config(cfg))
    else:
        model = Qwen2ForCausalLM(qwen2_config(cfg))
    model.generation_config = GenerationConfig(
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    return model


def save_model_dir(model: PreTrainedModel, model_dir: str | Path) -> Path:
    """Write weights (safetensors), configs and the tokenizer into ``model_dir``."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    add_legacy_config_keys(model_dir / "config.json")
    write_tokenizer(model_dir)
    return model_dir


def add_legacy_config_keys(config_path: Path) -> None:
    """Also write ``rope_theta`` / ``torch_dtype`` (and, for the MoE, ``num_experts``) at the
    top level of ``config.json``.

    transformers 5 nests RoPE settings under ``rope_parameters``, says ``dtype`` and saves a
    Qwen3-MoE's expert count as ``num_local_experts``; released Qwen2.5 / Qwen3-MoE
    checkpoints (and readers written for them: SGLang, whose Qwen3-MoE reads
    ``config.num_experts``, converters) use the flat keys. Writing both keeps the tiny
    directory shaped like a real checkpoint.
    """
    config = json.loads(config_path.read_text())
    if "num_local_experts" in config:
        config.setdefault("num_experts", config["num_local_experts"])
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_model_dir(model_dir: str | Path, cfg: TinyModelConfig | None = None) -> Path:
    """Create an untrained tiny model directory at ``model_dir``; returns the path."""
    return save_model_dir(build_model(cfg or TinyModelConfig()), model_dir)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a tiny model directory (either variant) with transformers, offline."""
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)


def describe(cfg: TinyModelConfig) -> dict:
    """Plain-dict view of ``cfg`` (for logs and the result marker)."""
    return asdict(cfg)
