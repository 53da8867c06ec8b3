"""One decode step of the embedded engine without the ``transformers`` module machinery.

A decode step feeds one token per row. At the embedded engine's usual shapes (the tiny CPU
model, a few dozen rows) the model's arithmetic is small and most of an HF forward is the
machinery around it: keyword plumbing and decorators on every module, the 4-D mask built
again each step, output dataclasses. :class:`DecodeStep` runs the same operations on the same
parameters, in the same order, for the decoder families it knows (Qwen2, Llama): per layer
the model's own input norm, the q/k/v projections, rotary embedding (the model's own
``rotary_emb`` and its modeling module's ``apply_rotary_pos_emb``, so every RoPE scaling
type it supports), the KV-cache update, PyTorch's
scaled-dot-product attention, the output projection, the post-attention norm and the gated
MLP; then the final norm and ``lm_head`` on the one position.

Attention follows transformers' SDPA path for one query token: when no column of the chunk
is padding no mask is passed and grouped-query heads use ``enable_gqa``; otherwise the
padding mask (``[B, 1, 1, T]``, True = attend) is passed and each KV head's query heads are
packed into its query axis. With transformers 5.24 the logits are bit-identical to the HF
forward (``tests/unit/test_rollout_decode_step.py`` checks them within fp32 rounding for
Qwen2 and Llama, with and without padding and GQA); prefill stays on the HF forward.

:func:`decode_step_for` returns ``None`` for anything else (another architecture, another
attention implementation, sliding-window layers, an activation other than SiLU, hooks on
the modules): the engine then decodes through the HF forward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = {"qwen2": "Qwen2", "llama": "Llama"}
"""``config.model_type`` -> the transformers class prefix whose decode step this mirrors."""


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _has_hooks(model: nn.Module) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or getattr(m, "_hf_hook", None) is not None
        for m in model.modules()
    )


def decode_step_for(model: nn.Module) -> DecodeStep | None:
    """A :class:`DecodeStep` over ``model`` (an HF ``*ForCausalLM``), or ``None`` when its
    decode step is not one this module mirrors (see the module docstring)."""
    config = getattr(model, "config", None)
    prefix = FAMILIES.get(getattr(config, "model_type", None))
    if prefix is None or type(model).__name__ != f"{prefix}ForCausalLM":
        return None
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    if getattr(config, "hidden_act", None) != "silu" or _has_hooks(model):
        return None
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        return None
    body = model.model
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            type(attn).__name__ != f"{prefix}Attention"
            or type(mlp).__name__ != f"{prefix}MLP"
            or getattr(attn, "sliding_window", None) is not None
        ):
            return None
    return DecodeStep(model)


class DecodeStep:
    """``__call__(ids [B, 1], mask [B, T], positions [B, 1], cache) -> logits [B, V]``.

    ``mask`` covers the cached tokens and the new one (1 = real token); ``cache`` is the
    chunk's ``DynamicCache`` (any layer type with ``update(keys, values, layer_idx)``). The
    parameters are read from the modules at every call, so in-place weight updates and
    device moves are seen.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.body = model.model
        # the rotary application of the attention's own modeling module (what its forward calls)
        attention_module = sys.modules[type(self.body.layers[0].self_attn).__module__]
        self.apply_rotary = attention_module.apply_rotary_pos_emb

    @torch.inference_mode()
    def __call__(self, ids, mask, positions, cache) -> torch.Tensor:
        body = self.body
        rows = ids.shape[0]
        attend = None if bool(mask.all()) else mask.bool()[:, None, None, :]
        hidden = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(hidden, positions)
        for index, layer in enumerate(body.layers):
            attn, mlp = layer.self_attn, layer.mlp
            dim, groups = attn.head_dim, attn.num_key_value_groups
            x = layer.input_layernorm(hidden)
            q = _linear(x, attn.q_proj).view(rows, 1, -1, dim).transpose(1, 2)
            k = _linear(x, attn.k_proj).view(rows, 1, -1, dim).transpose(1, 2)
            v = _linear(x, attn.v_proj).view(rows, 1, -1, dim).transpose(1, 2)
            q, k = self.apply_rotary(q, k, cos, sin)
            k, v = cache.update(k, v, index)
            if groups == 1:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=attn.scaling)
            elif attend is None:
                out = F.scaled_dot_product_attention(q, k, v, scale=attn.scaling, enable_gqa=True)
            else:  # one query token: each KV head's query heads along its query axis
                packed = q.reshape(rows, -1, groups, dim)
                out = F.scaled_dot_product_attention(packed, k, v, attn_mask=attend,
                                                     scale=attn.scaling)  # fmt: skip
            out = out.reshape(rows, -1, 1, dim).transpose(1, 2).contiguous().reshape(rows, 1, -1)
            hidden = hidden + _linear(out, attn.o_proj)
            x = layer.post_attention_layernorm(hidden)
            x = F.silu(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj)
            hidden = hidden + _linear(x, mlp.down_proj)
        hidden = body.norm(hidden)
        return _linear(hidden, self.model.lm_head)[:, -1, :]
