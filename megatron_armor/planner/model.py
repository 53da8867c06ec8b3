"""Decoder dimensions (Qwen2/2.5, Qwen3, Llama 3, Qwen3-MoE) from an HF ``config.json`` or a
preset.

Only what the memory and FLOPs formulas need; no weights are read, so ``armor plan`` works for
a model that has not been downloaded (name a preset: ``qwen2.5-math-7b``, ``qwen3-8b``,
``llama-3-8b``, ``qwen3-30b-a3b``).

A mixture-of-experts model has ``moe_layers`` sparse layers: each holds a router (``E h``)
and ``E`` SwiGLU experts of width ``f_e`` (``3 h f_e`` each) in place of the dense MLP, and
routes each token to ``k`` of them. Its parameters split into the *expert* part
(``M E 3 h f_e``, sharded by expert parallelism) and the rest; the *active* parameters, those
a token meets, count ``k`` experts per sparse layer instead of ``E`` (docs/profiling.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_armor.config.moe import moe_shape


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
    num_experts: int = 0
    """``E``: routed experts per sparse layer (0: a dense model)."""
    topk: int = 0
    """``k``: experts each token is routed to."""
    expert_ffn: int = 0
    """``f_e``: width of one expert's SwiGLU MLP (``moe_intermediate_size``)."""
    moe_layers: int = 0
    """``M``: sparse layers (the other ``L - M`` have the dense MLP of width ``ffn_hidden``)."""

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0 and self.num_experts > 0

    def attention_params(self) -> int:
        """One layer's attention ``h(q + 2kv) + q h`` (+ Q/K/V biases)."""
        attn = self.hidden * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden
        return attn + (self.q_size + 2 * self.kv_size if self.qkv_bias else 0)

    def mlp_params(self) -> int:
        """One dense MLP: ``3 h f`` (SwiGLU) or ``2 h f``."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    def expert_params(self) -> int:
        """One expert: ``3 h f_e``."""
        return 3 * self.hidden * self.expert_ffn

    def layer_params(self) -> int:
        """Parameters of one dense layer: attention, MLP ``3hf``, 2 norms."""
        return self.attention_params() + self.mlp_params() + 2 * self.hidden

    def decoder_params(self, experts_per_layer: int | None = None) -> int:
        """All layers' parameters, with ``experts_per_layer`` experts in each sparse layer
        (default ``E``; ``k`` gives the active ones): ``L (attn + 2h) + (L - M) mlp
        + M (E h + n 3 h f_e)``."""
        n = self.num_experts if experts_per_layer is None else experts_per_layer
        dense_layers = self.layers - self.moe_layers
        common = self.layers * (self.attention_params() + 2 * self.hidden)
        sparse = self.moe_layers * (self.num_experts * self.hidden + n * self.expert_params())
        return common + dense_layers * self.mlp_params() + sparse

    def decoder_expert_params(self) -> int:
        """The experts of every sparse layer, ``M E 3 h f_e`` (what expert parallelism splits)."""
        return self.moe_layers * self.num_experts * self.expert_params()

    def embedding_params(self) -> int:
        """Input embedding ``V h``."""
        return self.vocab * self.hidden

    def output_params(self) -> int:
        """LM head ``V h`` (0 when tied) plus the final norm ``h``."""
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + self.hidden

    def total_params(self) -> int:
        return self.decoder_params() + self.embedding_params() + self.output_params()

    def active_params(self) -> int:
        """Parameters one token meets: ``k`` experts per sparse layer (= total when dense)."""
        return self.decoder_params(self.topk) + self.embedding_params() + self.output_params()


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
    # Qwen/Qwen3-30B-A3B config.json: every layer sparse (decoder_sparse_step 1, no
    # mlp_only_layers), 128 experts of width 768, top-8; 30.5B parameters, 3.3B active
    "qwen3-30b-a3b": ModelDims(
        "qwen3-30b-a3b", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
        ffn_hidden=6144, vocab=151936, num_experts=128, topk=8, expert_ffn=768, moe_layers=48,
    ),
}  # fmt: skip

_SUPPORTED_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")


def dims_from_hf_config(config: dict, name: str = "hf") -> ModelDims:
    """:class:`ModelDims` from the fields of an HF ``config.json`` (Qwen2/Qwen3/Llama, and
    Qwen3-MoE through ``config/moe.py``: its experts, top-k and sparse layers)."""
    model_type = config.get("model_type", "")
    if model_type not in _SUPPORTED_TYPES:
        raise ValueError(
            f"config.json model_type={model_type!r}: the planner knows {_SUPPORTED_TYPES}"
            "; name a preset instead"
        )
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    moe = moe_shape(config)
    experts = {} if moe is None else {
        "num_experts": moe.num_experts, "topk": moe.topk, "expert_ffn": moe.expert_ffn,
        "moe_layers": sum(moe.sparse_layers),
    }  # fmt: skip
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
        **experts,
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
