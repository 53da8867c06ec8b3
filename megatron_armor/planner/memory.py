"""Per-GPU memory estimate of one trainer rank and, when colocated, the SGLang engine beside it.

All terms are bytes per GPU (formulas in docs/profiling.md, "Memory model"). ``P_r`` is the
parameter count of the worst pipeline stage divided by TP:

- weights     ``P_r * w``                (w = 2 for bf16/fp16, 4 for fp32)
- grads       ``P_r * 4``                (megatron-core keeps fp32 ``main_grad`` buffers)
- optimizer   ``P_r * k / S``            (Adam: fp32 master + m + v, k = 12; k = 8 in fp32;
                                          S = dp * cp with the distributed optimizer, else 1)

  A mixture-of-experts model splits ``P_r`` in two: the dense part (attention, routers,
  norms, dense MLPs, embeddings) as above, and the experts ``X_r = M E 3 h f_e / (pp * ep *
  etp)`` (every expert's weights, grads and optimizer state sharded by expert and expert
  tensor parallelism), whose distributed-optimizer shards are the expert data-parallel
  ranks, ``S_e = tp * cp * dp / (etp * ep)``.
- activations ``n_fl * (L / pp) * T_mb * a * e``   (a: elements stored per token per layer,
              below; T_mb = micro_batch_tokens / cp; n_fl = micro-batches in flight on the
              first stage = min(pp, n_micro) * (1 + (pp - 1) / (pp * vpp)) with VPP)
      no recompute: ``a = 4h / t_sp + ((q + 2kv) + q + m_1 f + f) / tp``
                    (norm in/out twice; QKV out; attention out; fc1 out; act out;
                    t_sp = tp with sequence parallelism else 1; m_1 = 2 SwiGLU, 1 plain)
      a sparse layer replaces the MLP's ``(m_1 f + f) / tp`` by its router scores (``E`` in
      fp32) and its experts' inputs and outputs: each token reaches ``k`` experts, whose
      rows are gathered over the ``etp`` ranks (``2 etp k h``: input and output) and whose
      fc1 and activation outputs are split over them (``3 k f_e``), all ``/ t_sp``
      full recompute: ``a = h / t_sp`` per layer, plus one layer's full set for the recompute
- moe_dispatch ``(1 + etp) k T_mb h e / t_sp`` (a sparse layer's all-to-all send and receive
              buffers of its permuted tokens, the receive side gathered over ``etp``: one
              layer at a time)
- logits      ``T_mb * V/tp * e + 2 * min(T_mb, chunk) * V/tp * 4``  (LM-head output kept for
              backward, fp32 log-softmax and its gradient over one log-prob chunk; last stage)
- sglang      ``mem_fraction_static * GPU memory`` (weights + KV-cache pool, claimed at start;
              released while the trainer trains)
- runtime     CUDA context, NCCL and library workspaces: a fixed 1.5 GiB per process

Host memory of routing replay (``trainer.moe.routing_replay``, :func:`route_host_bytes`) for
a step of ``T`` tokens: the engines' routes in the batch (``r3``) ``T L k b`` per node (one
copy in Ray's object store, read by the node's ranks), the ``old`` pass's routes of a rank's
own samples ``T / dp * M / pp * k b`` per rank (``b`` = 1 byte per expert id up to 255
experts, else 2; ``M`` sparse layers); an update moves at most its shard's rows,
``T / (dp * updates) * M / pp * k b``, per rank.
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
    ep: int = 1
    """Expert-parallel size (a MoE model's experts split over ``ep`` ranks)."""
    etp: int = 1
    """Expert tensor-parallel size (each expert split over ``etp`` ranks)."""

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert shard: ``tp * cp * dp / (etp * ep)`` (>= 1)."""
        return max(1, self.tp * self.cp * self.dp // (self.etp * self.ep))


def param_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def stage_params(shape: TrainerShape, stage: int) -> float:
    """Parameters held by one rank of pipeline ``stage``: the dense part over TP (embedding
    first, LM head last) plus the experts (:func:`stage_expert_params`)."""
    return stage_dense_params(shape, stage) + stage_expert_params(shape)


def stage_dense_params(shape: TrainerShape, stage: int) -> float:
    """Everything but the experts, held by one TP rank of ``stage``."""
    d = shape.dims
    params = (d.decoder_params() - d.decoder_expert_params()) / shape.pp
    if stage == 0:
        params += d.embedding_params()
    if stage == shape.pp - 1:
        # With PP > 1 and tied embeddings the last stage keeps its own copy of the matrix.
        head = d.vocab * d.hidden if (not d.tied_embeddings or shape.pp > 1) else 0
        params += head + d.hidden
    return params / shape.tp


def stage_expert_params(shape: TrainerShape) -> float:
    """The experts a rank holds: its stage's sparse layers' experts over ``ep * etp``."""
    return shape.dims.decoder_expert_params() / shape.pp / (shape.ep * shape.etp)


def state_terms(shape: TrainerShape, stage: int) -> dict[str, float]:
    """weights / grads / optimizer bytes of a rank of ``stage``."""
    params = stage_params(shape, stage)
    experts = stage_expert_params(shape)
    adam = 8 if shape.precision == "fp32" else 12
    shards = shape.dp * shape.cp if shape.distributed_optimizer else 1
    expert_shards = shape.expert_dp if shape.distributed_optimizer else 1
    return {
        "weights": params * param_bytes(shape.precision),
        "grads": params * 4,
        "optimizer": (params - experts) * adam / shards + experts * adam / expert_shards,
    }


def activation_elements_per_token_layer(shape: TrainerShape) -> tuple[float, float]:
    """(stored elements per token per layer, elements of one layer's full set per token),
    averaged over the dense and sparse layers."""
    d = shape.dims
    sp = shape.tp if shape.sequence_parallel else 1
    fc1 = (2 if d.gated_mlp else 1) * d.ffn_hidden
    attention = 4 * d.hidden / sp + (d.q_size + 2 * d.kv_size + d.q_size) / shape.tp
    dense = attention + (fc1 + d.ffn_hidden) / shape.tp
    if not d.is_moe:
        return (d.hidden / sp if shape.recompute else dense), dense
    sparse = attention + moe_elements_per_token(shape)
    mean = (dense * (d.layers - d.moe_layers) + sparse * d.moe_layers) / d.layers
    largest = sparse if d.moe_layers == d.layers else max(dense, sparse)
    return (d.hidden / sp if shape.recompute else mean), largest


def moe_elements_per_token(shape: TrainerShape) -> float:
    """A sparse layer's MoE activations per token of the micro-batch: router scores (fp32),
    the ``k`` routed copies' expert inputs and outputs (gathered over ``etp``), their fc1
    and activation outputs (split over ``etp``)."""
    d = shape.dims
    sp = shape.tp if shape.sequence_parallel else 1
    router = d.num_experts * 4 / param_bytes(shape.precision)
    rows = 2 * shape.etp * d.topk * d.hidden + 3 * d.topk * d.expert_ffn
    return (router + rows) / sp


def moe_dispatch_bytes(shape: TrainerShape) -> float:
    """All-to-all buffers of one sparse layer: the permuted tokens sent (``k T h``) and
    received (gathered over ``etp``: ``etp k T h``), per rank; 0 for a dense model."""
    d = shape.dims
    if not d.is_moe:
        return 0.0
    sp = shape.tp if shape.sequence_parallel else 1
    tokens = shape.micro_batch_tokens / shape.cp / sp
    return (1 + shape.etp) * d.topk * tokens * d.hidden * param_bytes(shape.precision)


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
    if shape.dims.is_moe:
        terms["moe_dispatch"] = moe_dispatch_bytes(shape)
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


def route_host_bytes(
    dims: ModelDims, tokens: float, dp: int, pp: int, updates: int, engine_routes: bool
) -> dict[str, float]:
    """Host bytes of routing replay for a step of ``tokens`` tokens (module docstring):
    ``batch`` (the engines' routes, with ``engine_routes``; per node), ``old`` (a rank's own
    samples' routes of the ``old`` pass), ``update`` (what one update receives, at most)."""
    per_id = 1 if dims.num_experts < 255 else 2
    kept = tokens / dp * (dims.moe_layers / pp) * dims.topk * per_id
    return {
        "batch": tokens * dims.layers * dims.topk * per_id if engine_routes else 0.0,
        "old": kept,
        "update": kept / max(1, updates),
    }
