"""The one adapter over megatron-core's global ``parallel_state`` (docs/architecture.md).

Everything else in the trainer asks this module for ranks, sizes and process groups, so the
dependence on megatron's global state sits in one place. :func:`init_parallel` starts
``torch.distributed`` (gloo on CPU, nccl on GPU) and megatron's model-parallel groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_armor.trainer.cpu_collectives import install_uneven_collectives
from megatron_armor.trainer.cpu_compat import enable_cpu_mode


@dataclass(frozen=True)
class ParallelLayout:
    """How the trainer ranks are factored: ``world = tp * pp * cp * dp`` (a loaded config
    factors: ``config/validate.py: check_parallel``)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    vpp: int = 1
    """Virtual pipeline stages per rank (1 = off)."""
    ep: int = 1
    """Expert-parallel size (MoE layers: the world is also factored as ``etp * ep * pp *
    expert-dp``; ``config/moe.py``)."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's weights split over ``etp`` ranks, apart
    from ``tp`` (megatron-core's ``expert_tensor_parallel_size``)."""


def init_parallel(
    layout: ParallelLayout,
    rank: int = 0,
    world_size: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    seed: int = 1,
    timeout_s: float = 600.0,
) -> None:
    """Start torch.distributed and megatron's model-parallel groups, then seed the RNGs.

    On CPU the process first switches to CPU mode (``cpu_compat``) and uses gloo, with host
    versions of megatron's uneven gathers (``cpu_collectives``: expert tensor parallelism).
    """
    cpu = enable_cpu_mode()
    if cpu:
        install_uneven_collectives()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", master_addr)
        os.environ.setdefault("MASTER_PORT", str(master_port))
        if not cpu:
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            )
        dist.init_process_group(
            backend="gloo" if cpu else "nccl",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Seed torch (and megatron's model-parallel CUDA RNG streams on GPU)."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- ranks and sizes -----------------------------------------------------------------------


def tp_rank() -> int:
    return ps.get_tensor_model_parallel_rank()


def tp_size() -> int:
    return ps.get_tensor_model_parallel_world_size()


def tp_group() -> dist.ProcessGroup:
    return ps.get_tensor_model_parallel_group()


def pp_rank() -> int:
    return ps.get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return ps.get_pipeline_model_parallel_world_size()


def pp_group() -> dist.ProcessGroup:
    return ps.get_pipeline_model_parallel_group()


def is_first_stage() -> bool:
    return ps.is_pipeline_first_stage(ignore_virtual=True)


def is_last_stage() -> bool:
    return ps.is_pipeline_last_stage(ignore_virtual=True)


def dp_rank() -> int:
    return ps.get_data_parallel_rank()


def dp_size() -> int:
    return ps.get_data_parallel_world_size()


def dp_group() -> dist.ProcessGroup:
    return ps.get_data_parallel_group()


def ep_rank() -> int:
    return ps.get_expert_model_parallel_rank()


def ep_size() -> int:
    return ps.get_expert_model_parallel_world_size()


def ep_group() -> dist.ProcessGroup:
    return ps.get_expert_model_parallel_group()


def expert_tp_rank() -> int:
    return ps.get_expert_tensor_parallel_rank()


def expert_tp_size() -> int:
    return ps.get_expert_tensor_parallel_world_size()


def expert_tp_group() -> dist.ProcessGroup:
    return ps.get_expert_tensor_parallel_group()


def cp_rank() -> int:
    return ps.get_context_parallel_rank()


def is_reporting_rank() -> bool:
    """Last pipeline stage, TP rank 0, CP rank 0: the ranks that return per-token results."""
    return is_last_stage() and tp_rank() == 0 and cp_rank() == 0


def is_export_rank() -> bool:
    """TP rank 0 and DP rank 0 of each pipeline stage: the ranks that yield exported tensors."""
    return tp_rank() == 0 and dp_rank() == 0 and cp_rank() == 0


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def collective_device() -> torch.device:
    """Where tensors handed to collectives must live (CPU under gloo)."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def all_ranks_agree(flag: bool) -> bool:
    """``flag`` and-ed over every rank of the world group (one all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
