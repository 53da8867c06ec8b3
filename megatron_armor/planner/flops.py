"""Model FLOPs of a decoder (the MFU numerator); derivation in docs/profiling.md.

For one sequence of ``s`` tokens, counting a multiply-add as 2 FLOPs and the causal mask
(token ``i`` attends to ``i + 1`` positions):

    N_mm   = L (h (q + 2 kv) + q h + m h f) + V h          (matmul weights; m = 3 SwiGLU, 2 plain)

and for a mixture-of-experts model the *active* weights: the ``M`` sparse layers count their
router ``E h`` and the ``k`` experts a token is routed to, ``k 3 h f_e``, in place of the MLP
(``N_mm = L attn + (L - M) m h f + M (E h + 3 k h f_e) + V h``), so the MFU of a MoE run is
measured against the work its tokens do, not against all its experts:
    F_fwd  = 2 s N_mm  +  2 L n_h d s (s + 1)              (projections + QK^T and AV)
    F_train = 3 F_fwd                                      (backward = 2x forward)

with ``q = n_h d``, ``kv = n_kv d`` (GQA). The LM head counts even with tied embeddings (the
matmul still runs); the embedding lookup, norms, activations and softmax are left out (< 1%).
Model FLOPs do not count activation recomputation (that would be hardware FLOPs, ``4 F_fwd``).
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_armor.planner.model import ModelDims


def matmul_params(dims: ModelDims) -> int:
    """``N_mm``: weights that take part in a matmul per token (LM head included, biases not;
    the active experts only)."""
    attn = dims.hidden * (dims.q_size + 2 * dims.kv_size) + dims.q_size * dims.hidden
    sparse = dims.num_experts * dims.hidden + dims.topk * dims.expert_params()
    dense_layers = dims.layers - dims.moe_layers
    mlps = dense_layers * dims.mlp_params() + dims.moe_layers * sparse
    return dims.layers * attn + mlps + dims.vocab * dims.hidden


def forward_flops(dims: ModelDims, seq_len: int) -> float:
    """``F_fwd(s) = 2 s N_mm + 2 L n_h d s (s + 1)`` for one causal sequence of ``s`` tokens."""
    s = seq_len
    dense = 2.0 * s * matmul_params(dims)
    attention = 2.0 * dims.layers * dims.heads * dims.head_dim * s * (s + 1)
    return dense + attention


def training_flops(dims: ModelDims, seq_lens: Iterable[int]) -> float:
    """Model FLOPs of one forward + backward over sequences of lengths ``seq_lens``: ``3 sum F_fwd``."""
    return 3.0 * sum(forward_flops(dims, s) for s in seq_lens)


def logprob_flops(dims: ModelDims, seq_lens: Iterable[int]) -> float:
    """Forward-only passes (old / reference log-probs): ``sum F_fwd``."""
    return sum(forward_flops(dims, s) for s in seq_lens)
