"""Tiny random HF models (Qwen2, Qwen3, Llama 3 with rope scaling, Qwen3-MoE) and a
deterministic ARMOR batch, shared by the trainer tests and their worker processes."""

from __future__ import annotations

import os
import random

import torch

from megatron_armor.types import Group, Sample, SampleSource, TrainBatch, pack_groups

VOCAB = 200  # not a multiple of 128: the padded vocabulary is exercised


def make_models(root: str) -> dict[str, str]:
    """Save the tiny models under ``root``; returns ``{name: model_dir}``."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    configs = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common, tie_word_embeddings=False)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)),
        "llama": (
            LlamaForCausalLM,
            LlamaConfig(
                **common,
                tie_word_embeddings=False,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                rope_theta=500000.0,
            ),
        ),
    }
    dirs = {}
    for i, (name, (cls, cfg)) in enumerate(configs.items()):
        torch.manual_seed(100 + i)
        model = cls(cfg)
        with torch.no_grad():  # non-trivial norm weights and biases
            for pname, p in model.named_parameters():
                if "norm" in pname or pname.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        dirs[name] = os.path.join(root, name)
        model.save_pretrained(dirs[name])
    return dirs


MOE_EXPERTS = 4


def make_moe_model(root: str, num_layers: int = 3) -> str:
    """A tiny random Qwen3-MoE under ``root/qwen3_moe``: ``num_layers`` layers (layer 1 dense:
    ``mlp_only_layers``, the others sparse), 4 experts, top-2 with renormalised probabilities; the routers get
    large weights so that every token's top-2 is decided by a wide margin (no near-ties that
    rounding could flip between implementations)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_experts=MOE_EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(110)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.1 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    path = os.path.join(root, "qwen3_moe")
    model.save_pretrained(path)
    return path


def oracle_tokens() -> torch.Tensor:
    """``[2, 21]`` token ids for the logits oracle."""
    return torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(7))


def make_batch(seed: int = 0) -> TrainBatch:
    """Two groups of 4 samples (the last one an anchor) of unequal lengths, with advantages."""
    rng = random.Random(seed)
    groups = []
    for g in range(2):
        samples = []
        for i in range(4):
            prompt = [rng.randrange(VOCAB) for _ in range(3 + g)]
            response = [rng.randrange(VOCAB) for _ in range(2 + 3 * i + g)]
            source = SampleSource.REFERENCE if i == 3 else SampleSource.POLICY
            samples.append(Sample(f"q{g}", prompt, response, source=source))
        groups.append(
            Group(
                f"q{g}",
                samples,
                anchor_index=3,
                advantages=[1.0, -0.5, -1.5, 1.0] if g == 0 else [-1.0, 0.5, -0.5, 1.0],
            )
        )
    return pack_groups(groups)


def perturb(logprobs: torch.Tensor, mask: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    """Log-probs shifted by deterministic noise (so ratios leave the clip range)."""
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(seed))
    return (logprobs + scale * noise) * mask
