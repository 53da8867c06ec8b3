"""Per-GPU memory estimate of one trainer rank and, when colocated, the SGLang engine beside it.

All terms are bytes per GPU (formulas in docs/profiling.md, "Memory model"). ``P_r`` is the
parameter count of the worst pipeline stage divided by TP:

- weights     ``P_r * w``                (w = 2 for bf16/fp16, 4 for fp32)
- grads       ``P_r * 4``                (megatron-core keeps fp32 ``main_grad`` buffers)
- optimizer   ``P_r * k / S``            (Adam: fp32 master + m + v, k = 12; k = 8 in fp32;
                                          S = dp * cp with the distributed optimizer, else 1)
- activations ``n_fl * (L / pp) * T_mb * a * e``   (a: elements stored per token per layer,
              below; T_mb = micro_batch_tokens / cp; n_fl = micro-batches in flight on the
              first stage = min(pp, n_micro) * (1 + (pp - 1) / (pp * vpp)) with VPP)
      no recompute: ``a = 4h / t_sp + ((q + 2kv) + q + m_1 f + f) / tp``
                    (norm in/out twice; QKV out; attention out; fc1 out; act out;
                    t_sp = tp with sequence parallelism else 1; m_1 = 2 SwiGLU, 1 plain)
      full recompute: ``a = h / t_sp`` per layer, plus one layer's full set for the recompute
- logits      ``T_mb * V/tp * e + 2 * min(T_mb, chunk) * V/tp * 4``  (LM-head output kept for
              backward, fp32 log-softmax and its gradient over one log-prob chunk; last stage)
- sglang      ``mem_fraction_static * GPU memory`` (weights + KV-cache pool, claimed at start;
              released while the trainer trains)
- runtime     CUDA context, NCCL and library workspaces: a fixed 1.5 GiB per process
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.planner.model import ModelDims

GiB = 1024**3
RUNTIME_BYTES = int(1.5 * GiB)


@dataclass(frozen=True)
class TrainerShape:
    """What the trainer memory depends on."""

    dims: ModelDims
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    precision: str = "bf16"
    distributed_optimizer: bool = False
    recompute: bool = False
    micro_batch_tokens: int = 4096
    num_micro_batches: int = 1
    logprob_chunk: int = 1024


def param_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def stage_params(shape: TrainerShape, stage: int) -> float:
    """Parameters held by one TP rank of pipeline ``stage`` (embedding first, LM head last)."""
    d = shape.dims
    params = d.layers / shape.pp * d.layer_params()
    if stage == 0:
        params += d.embedding_params()
    if stage == shape.pp - 1:
        # With PP > 1 and tied embeddings the last stage keeps its own copy of the matrix.
        head = d.vocab * d.hidden if (not d.tied_embeddings or shape.pp > 1) else 0
        params += head + d.hidden
    return params / shape.tp


def state_terms(shape: TrainerShape, stage: int) -> dict[str, float]:
    """weights / grads / optimizer bytes of a rank of ``stage``."""
    params = stage_params(shape, stage)
    adam = 8 if shape.precision == "fp32" else 12
    shards = shape.dp * shape.cp if shape.distributed_optimizer else 1
    return {
        "weights": params * param_bytes(shape.precision),
        "grads": params * 4,
        "optimizer": params * adam / shards,
    }


def activation_elements_per_token_layer(shape: TrainerShape) -> tuple[float, float]:
    """(stored elements per token per layer, elements of one layer's full set per token)."""
    d = shape.dims
    sp = shape.tp if shape.sequence_parallel else 1
    fc1 = (2 if d.gated_mlp else 1) * d.ffn_hidden
    full = 4 * d.hidden / sp + (d.q_size + 2 * d.kv_size + d.q_size + fc1 + d.ffn_hidden) / shape.tp
    stored = d.hidden / sp if shape.recompute else full
    return stored, full


def in_flight_micro_batches(shape: TrainerShape) -> float:
    """Micro-batches whose activations the first stage holds at once under 1F1B (+VPP)."""
    n = min(shape.pp, max(1, shape.num_micro_batches))
    if shape.vpp > 1:
        n *= 1 + (shape.pp - 1) / (shape.pp * shape.vpp)
    return n


def activation_bytes(shape: TrainerShape, stage: int) -> float:
    """Activations kept for backward on a rank of ``stage``."""
    stored, full = activation_elements_per_token_layer(shape)
    tokens = shape.micro_batch_tokens / shape.cp
    elem = param_bytes(shape.precision)
    in_flight = in_flight_micro_batches(shape) if stage == 0 else 1
    kept = in_flight * (shape.dims.layers / shape.pp) * tokens * stored * elem
    if shape.recompute:
        kept += tokens * full * elem
    return kept


def logits_bytes(shape: TrainerShape) -> float:
    """LM-head output and the fp32 log-softmax working set (last stage)."""
    tokens = shape.micro_batch_tokens / shape.cp
    vocab_shard = shape.dims.vocab / shape.tp
    chunk = min(tokens, shape.logprob_chunk)
    return tokens * vocab_shard * param_bytes(shape.precision) + 2 * chunk * vocab_shard * 4


def trainer_train_terms(shape: TrainerShape, stage: int) -> dict[str, float]:
    """All trainer terms of a rank of ``stage`` during the training pass."""
    terms = state_terms(shape, stage)
    terms["activations"] = activation_bytes(shape, stage)
    terms["logits"] = logits_bytes(shape) if stage == shape.pp - 1 else 0.0
    terms["runtime"] = RUNTIME_BYTES
    return terms


@dataclass(frozen=True)
class EngineShape:
    """An SGLang engine's share of one GPU."""

    dims: ModelDims
    tp: int = 1
    mem_fraction_static: float = 0.7
    gpu_bytes: float = 80 * GiB

    def static_bytes(self) -> float:
        """Weights + KV pool that SGLang claims at start: ``mem_fraction_static * GPU``."""
        return self.mem_fraction_static * self.gpu_bytes

    def weight_bytes(self) -> float:
        """bf16 weights of one engine TP rank."""
        return self.dims.total_params() * 2 / self.tp

    def kv_pool_bytes(self) -> float:
        """What is left of the static share for the KV cache."""
        return self.static_bytes() - self.weight_bytes()

    def kv_bytes_per_token(self) -> float:
        """``2 (K, V) * L * max(1, n_kv / tp) * d * 2 bytes`` on one engine rank."""
        d = self.dims
        heads = max(1.0, d.kv_heads / self.tp)
        return 2 * d.layers * heads * d.head_dim * 2

    def kv_tokens(self) -> int:
        return max(0, int(self.kv_pool_bytes() // self.kv_bytes_per_token()))
