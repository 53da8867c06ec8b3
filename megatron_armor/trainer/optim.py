"""megatron-core DDP, optimizer (Adam, optional distributed optimizer) and LR schedule.

Gradient scaling contract: the loss that ``loss_func`` returns is already the local sum divided
by the GLOBAL normalizer (``algo.compute_policy_loss``), so gradients must be *summed* over
micro-batches and data-parallel ranks, never averaged. That is megatron-core's
``calculate_per_token_loss`` mode (DDP scaling factor 1, the schedule does not divide by the
number of micro-batches); the per-token rescaling that ``finalize_model_grads`` would apply in
that mode is switched off because the normalizer was applied already.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_armor.config.schema import TrainerConfig

# the schedule is "warm-up then constant": the decay horizon only has to exceed any run length
_CONSTANT_HORIZON = 10**9


def _finalize_grads_presummed(model, num_tokens=None, **kwargs) -> None:
    """``finalize_model_grads`` without the per-token rescaling (see module docstring)."""
    finalize_model_grads(model, None, **kwargs)


def wrap_ddp(model: torch.nn.Module, trainer: TrainerConfig) -> DistributedDataParallel:
    """Wrap the ``GPTModel`` in megatron-core DDP (gradient buffers, DP all-reduce)."""
    config = model.config
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=trainer.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = _finalize_grads_presummed
    return ddp


def build_optimizer(ddp: DistributedDataParallel, trainer: TrainerConfig):
    """``(optimizer, scheduler)``: Adam(W) with grad clipping, linear warm-up then constant."""
    config = ddp.config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=trainer.lr,
        min_lr=trainer.min_lr,
        weight_decay=trainer.weight_decay,
        adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2,
        adam_eps=trainer.adam_eps,
        clip_grad=trainer.grad_clip,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=trainer.use_distributed_optimizer,
        loss_scale=None,
        initial_loss_scale=2**16,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    config.grad_scale_func = optimizer.scale_loss if config.fp16 else None
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if trainer.warmup_steps > 0 else trainer.lr,
        max_lr=trainer.lr,
        min_lr=trainer.min_lr,
        lr_warmup_steps=trainer.warmup_steps,
        lr_decay_steps=_CONSTANT_HORIZON,
        lr_decay_style="constant",
        start_wd=trainer.weight_decay,
        end_wd=trainer.weight_decay,
        wd_incr_steps=_CONSTANT_HORIZON,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
