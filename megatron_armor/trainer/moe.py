"""Mixture-of-experts layers of the policy (Qwen3-MoE) on megatron-core (docs/trainer.md,
"Mixture of experts").

A model whose ``config.json`` has experts (``config/moe.py``: :func:`moe_shape`) is built as a
``GPTModel`` whose sparse layers are megatron-core ``MoELayer`` s: a ``TopKRouter`` and the
experts, ``SequentialMLP`` (one megatron MLP per local expert) with the local spec on CPU,
``TEGroupedMLP`` (Transformer Engine's grouped GEMM) with ``trainer.transformer_impl: te``.
Only a MoE model takes these paths; a dense model is built without any of them.

Routing matches transformers' ``Qwen3MoeTopKRouter``: router logits in fp32, softmax, top-k.
With ``norm_topk_prob`` the kept probabilities are renormalised, which equals a softmax over
the top-k logits (megatron's ``moe_router_pre_softmax=False``); without it they are the
top-k of the softmax over all experts (``moe_router_pre_softmax=True``). Tokens travel to
their experts' EP ranks through the all-to-all dispatcher (gloo runs it on CPU).

The load-balancing loss (``trainer.moe.aux_loss_coeff``) is megatron's Switch loss, attached
by each router to its routing probabilities (``MoEAuxLossAutoScaler``). In the trainer's
``calculate_per_token_loss`` mode the router attaches ``aux * tokens`` per micro-batch and the
gradients are summed, never divided (``optim.py``); :func:`scale_aux_loss` therefore sets the
coefficient of each update to ``coeff / routed tokens of the update`` (all micro-batches and
data-parallel ranks), so the gradient is ``coeff`` times the token-weighted mean of the
per-micro-batch losses. :func:`aux_loss_metrics` reads the mean per-layer loss for logging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)

from megatron_armor.config.moe import MoEShape
from megatron_armor.config.schema import TrainerConfig
from megatron_armor.trainer import parallel

# megatron-core 0.16.1 binds Transformer Engine's fused MoE kernels in moe_utils only when TE
# imports, yet the router's gating GEMM tests ``te_general_gemm is not None`` unconditionally:
# without TE (CPU, or the local spec) the name must exist, as None, for the torch path to run
_TE_KERNELS = (
    "te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
    "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
)  # fmt: skip
if not moe_utils.HAVE_TE:
    for _name in _TE_KERNELS:
        setattr(moe_utils, _name, getattr(moe_utils, _name, None))

AUX_LOSS_NAME = "load_balancing_loss"
"""megatron-core's tracker name of the Switch load-balancing loss."""
AUX_LOSS_METRIC = "train/moe_aux_loss"


def moe_config_fields(moe: MoEShape, trainer: TrainerConfig) -> dict:
    """``TransformerConfig`` fields of a MoE model (beside the dense ones of ``model.py``)."""
    coeff = trainer.moe.aux_loss_coeff
    return {
        "num_moe_experts": moe.num_experts,
        "moe_ffn_hidden_size": moe.expert_ffn,
        "moe_router_topk": moe.topk,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none",
        "moe_aux_loss_coeff": coeff,
        "moe_layer_freq": moe.layer_pattern,
        "moe_grouped_gemm": trainer.transformer_impl == "te",
        "expert_model_parallel_size": parallel.ep_size(),
        "expert_tensor_parallel_size": parallel.expert_tp_size(),
        # every router takes its top-k through a RouteReplay (routing_replay.py): replay,
        # recording and the routing metrics; without a pass's routing it is the router's own
        "moe_enable_routing_replay": True,
    }


def moe_block_spec(config, transformer_impl: str):
    """This pipeline stage's layer specs: MoE layers where the model is sparse, dense MLP
    layers elsewhere (``moe_layer_freq``), local or Transformer Engine modules."""
    return get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=transformer_impl == "te",
        normalization="RMSNorm",
        pp_rank=parallel.pp_rank(),
    )


def routed_tokens(micro_batches) -> float:
    """Token positions the routers see in ``micro_batches`` (padding and fillers included:
    the routers route them too, and megatron-core 0.16.1 cannot leave a whole filler out of
    the loss, docs/trainer.md), summed over the data-parallel ranks."""
    local = sum(mb.tokens.numel() for mb in micro_batches)
    total = torch.tensor([float(local)], device=parallel.collective_device())
    if parallel.dp_size() > 1:
        dist.all_reduce(total, group=parallel.dp_group())
    return float(total.item())


def scale_aux_loss(model, coeff: float, micro_batches) -> None:
    """Set the routers' load-balancing coefficient for one update (module docstring):
    ``coeff / routed tokens``. A no-op for a model built without the loss (``coeff`` 0 at
    start: megatron's routers then never compute it)."""
    if model.config.moe_router_load_balancing_type == "none":
        return
    tokens = routed_tokens(micro_batches)
    model.config.moe_aux_loss_coeff = coeff / max(tokens, 1.0) if coeff > 0 else 0.0
    clear_aux_losses_tracker()


def aux_loss_metrics(model, moe: MoEShape, num_micro_batches: int) -> dict[str, float]:
    """``train/moe_aux_loss``: the Switch load-balancing loss (without its coefficient) of the
    last update, averaged over the MoE layers and over the micro-batches of every
    data-parallel rank; ``{}`` when the loss is off (coefficient 0: the routers skip it). Collective over the world (every rank
    calls it, a pipeline stage without MoE layers too)."""
    if model.config.moe_router_load_balancing_type == "none" or not model.config.moe_aux_loss_coeff:
        return {}
    dev = parallel.collective_device()
    tracker = get_moe_layer_wise_logging_tracker().get(AUX_LOSS_NAME)
    values = (
        tracker["values"].detach().to(dev).clone()
        if tracker is not None
        else torch.zeros(len(moe.sparse_layers), device=dev)
    )
    count = torch.tensor([float(num_micro_batches)], device=dev)
    if parallel.pp_size() > 1:
        dist.all_reduce(values, group=parallel.pp_group())
    if parallel.dp_size() > 1:
        dist.all_reduce(values, group=parallel.dp_group())
        dist.all_reduce(count, group=parallel.dp_group())
    clear_aux_losses_tracker()
    layers = max(sum(moe.layer_pattern), 1)
    return {AUX_LOSS_METRIC: float(values.sum()) / layers / max(float(count.item()), 1.0)}
