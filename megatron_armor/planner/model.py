"""Dense decoder dimensions (Qwen2/2.5, Qwen3, Llama 3) from an HF ``config.json`` or a preset.

Only what the memory and FLOPs formulas need; no weights are read, so ``armor plan`` works for
a model that has not been downloaded (name a preset: ``qwen2.5-math-7b``, ``qwen3-8b``,
``llama-3-8b``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelDims:
    """Sizes of a dense decoder with GQA attention and a (gated) MLP."""

    name: str
    hidden: int
    """``h``: hidden size."""
    layers: int
    """``L``: transformer layers."""
    heads: int
    """``n_h``: query heads."""
    kv_heads: int
    """``n_kv``: key/value heads (GQA; ``== heads`` for MHA)."""
    head_dim: int
    """``d``: per-head size (``h / n_h`` unless the config says otherwise, e.g. Qwen3)."""
    ffn_hidden: int
    """``f``: MLP intermediate size."""
    vocab: int
    """``V``: vocabulary size (un-padded)."""
    gated_mlp: bool = True
    """SwiGLU (gate, up, down: 3 matrices) vs a plain 2-matrix MLP."""
    tied_embeddings: bool = False
    """Input embedding and LM head share one matrix."""
    qkv_bias: bool = False
    """Biases on Q/K/V (Qwen2/2.5)."""

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one layer: attention ``h(q + 2kv) + q h`` (+biases), MLP ``3hf``, 2 norms."""
        attn = self.hidden * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden
        return attn + mlp + 2 * self.hidden

    def embedding_params(self) -> int:
        """Input embedding ``V h``."""
        return self.vocab * self.hidden

    def output_params(self) -> int:
        """LM head ``V h`` (0 when tied) plus the final norm ``h``."""
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + self.hidden

    def total_params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.output_params()


PRESETS: dict[str, ModelDims] = {
    "qwen2.5-math-7b": ModelDims(
        "qwen2.5-math-7b", hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128,
        ffn_hidden=18944, vocab=152064, qkv_bias=True,
    ),
    "qwen3-8b": ModelDims(
        "qwen3-8b", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
        ffn_hidden=12288, vocab=151936,
    ),
    "llama-3-8b": ModelDims(
        "llama-3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
        ffn_hidden=14336, vocab=128256,
    ),
}  # fmt: skip

_SUPPORTED_TYPES = ("qwen2", "qwen3", "llama")


def dims_from_hf_config(config: dict, name: str = "hf") -> ModelDims:
    """:class:`ModelDims` from the fields of an HF ``config.json`` (Qwen2/Qwen3/Llama)."""
    model_type = config.get("model_type", "")
    if model_type not in _SUPPORTED_TYPES:
        raise ValueError(
            f"config.json model_type={model_type!r}: the planner knows {_SUPPORTED_TYPES} "
            "(dense decoders); name a preset instead"
        )
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    return ModelDims(
        name=name,
        hidden=hidden,
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        ffn_hidden=config["intermediate_size"],
        vocab=config["vocab_size"],
        gated_mlp=config.get("hidden_act", "silu") in ("silu", "swiglu"),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
    )


def _preset_key(name: str) -> str:
    return Path(name.rstrip("/")).name.lower().replace("_", "-").replace("-base", "")


def load_model_dims(source: str) -> ModelDims:
    """Dims from a preset name, an HF model dir / ``config.json`` path, or a hub-style name.

    A directory or file that exists wins; otherwise the last path component is matched against
    the presets (``Qwen/Qwen3-8B-Base`` -> ``qwen3-8b``).
    """
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return dims_from_hf_config(json.loads(path.read_text()), name=str(source))
    key = _preset_key(source)
    if key in PRESETS:
        return PRESETS[key]
    raise ValueError(
        f"model {source!r}: not an HF model directory or config.json, and not a preset; "
        f"presets: {', '.join(PRESETS)} (use `armor plan ... --model NAME`)"
    )


def with_padded_vocab(dims: ModelDims, tp: int, divisor: int = 128) -> ModelDims:
    """Megatron pads the vocabulary to a multiple of ``divisor * tp``."""
    multiple = divisor * tp
    padded = -(-dims.vocab // multiple) * multiple
    return replace(dims, vocab=padded)
