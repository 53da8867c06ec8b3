"""HF <-> megatron-core names of the mixture-of-experts parameters (Qwen3-MoE), with expert
parallelism (``hf_weights.py`` holds the rest of the map and does the reading and writing).

===========================================================  ==================================
megatron parameter (layer ``i`` of the stage)                HF tensors (layer ``offset + i``)
===========================================================  ==================================
``mlp.router.weight``                                        ``mlp.gate.weight`` (replicated)
``mlp.experts.local_experts.{j}.linear_fc1.weight`` (local)  ``mlp.experts.{e}.gate_proj`` and
``mlp.experts.linear_fc1.weight{j}`` (TE grouped GEMM)       ``up_proj`` (``gate_up`` layout)
``...local_experts.{j}.linear_fc2.weight`` / ``fc2.weight{j}``  ``mlp.experts.{e}.down_proj`` (row)
===========================================================  ==================================

Local expert ``j`` of expert-parallel rank ``r`` is global expert ``e = r * E / ep + j``
(megatron-core's ``MoELayer.local_expert_indices``). Expert weights are split over the
expert-tensor-parallel group (``trainer.etp``, megatron-core's ``expert_tensor_parallel_size``,
apart from ``tp``) like a dense MLP: ``gate_up`` by rows of each half, ``row`` by columns.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megatron_armor.trainer import parallel

_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$")
_LOCAL_EXPERT = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$"
)
_GROUPED_EXPERT = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$"
)


def expert_slot(name: str) -> tuple[int, int, int] | None:
    """``(layer, local expert, 1 | 2)`` of an expert's ``linear_fc1`` / ``linear_fc2`` weight
    (local or grouped-GEMM naming); ``None`` for any other parameter."""
    match = _LOCAL_EXPERT.match(name)
    if match:
        return int(match.group(1)), int(match.group(2)), int(match.group(3))
    match = _GROUPED_EXPERT.match(name)
    if match:
        return int(match.group(1)), int(match.group(3)), int(match.group(2))
    return None


def moe_hf_source(
    name: str, num_experts: int, offset: int, ep_rank: int, ep_size: int
) -> tuple[str, tuple[str, ...], bool] | None:
    """``(kind, HF names, is_expert)`` of a MoE parameter as held by expert-parallel rank
    ``ep_rank`` (kinds as in ``hf_weights.py``); ``None`` for a parameter that is not one."""
    match = _ROUTER.match(name)
    if match:
        layer = offset + int(match.group(1))
        return "replicated", (f"model.layers.{layer}.mlp.gate.weight",), False
    slot = expert_slot(name)
    if slot is None:
        return None
    layer, local, fc = slot
    expert = ep_rank * (num_experts // ep_size) + local
    prefix = f"model.layers.{offset + layer}.mlp.experts.{expert}."
    if fc == 1:
        return "gate_up", (prefix + "gate_proj.weight", prefix + "up_proj.weight"), True
    return "row", (prefix + "down_proj.weight",), True


def gather_group(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's ``tensor`` over ``group`` (of ``size`` ranks), in rank order."""
    if size == 1:
        return [tensor.detach()]
    local = tensor.detach().to(parallel.collective_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return parts


def gather_expert_parts(param: torch.Tensor) -> list[torch.Tensor]:
    """The expert-tensor-parallel shards of one local expert's weight."""
    return gather_group(param, parallel.expert_tp_group(), parallel.expert_tp_size())


def gather_over_ep(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``[per EP rank r: [tensors of r's expert in the same slot]]``: the full HF tensors of
    one local-expert slot from every expert-parallel rank (collective over the EP group)."""
    size = parallel.ep_size()
    per_tensor = [gather_group(t, parallel.ep_group(), size) for t in tensors]
    return [[parts[r] for parts in per_tensor] for r in range(size)]
