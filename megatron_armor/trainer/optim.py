"""megatron-core DDP, optimizer (Adam, optional distributed optimizer) and LR schedule.

Gradient scaling contract: the loss that ``loss_func`` returns is already the local sum divided
by the GLOBAL normalizer (``algo.compute_policy_loss``), so gradients must be *summed* over
micro-batches and data-parallel ranks, never averaged. That is megatron-core's
``calculate_per_token_loss`` mode (DDP scaling factor 1, the schedule does not divide by the
number of micro-batches); the per-token rescaling that ``finalize_model_grads`` would apply in
that mode is switched off because the normalizer was applied already.
"""

from __future__ import annotations

import math

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_armor.config.schema import TrainerConfig
from megatron_armor.trainer import parallel

# a constant schedule still needs a decay horizon past the warm-up: longer than any run
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
    """``(optimizer, scheduler)``: Adam(W) with grad clipping and :func:`build_lr_scheduler`."""
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
    return optimizer, build_lr_scheduler(optimizer, trainer)


def guarded_step(optimizer, loss_is_finite: bool) -> tuple[bool, float]:
    """The optimizer step of megatron-core (``ChainedOptimizer.step``: gradients prepared, the
    global norm, clipping by it, the inner step), taken only when the update is finite on
    every rank (docs/trainer.md, non-finite guard): ``loss_is_finite`` (this rank's losses),
    no overflow found by fp16 loss scaling, and a finite global gradient norm, and-ed over the
    world group (one all-reduce), so every rank steps or none does. Returns ``(applied,
    grad_norm)``; the norm is computed (and logged) also with ``trainer.grad_clip: 0``."""
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    finite = loss_is_finite and not found_inf and math.isfinite(grad_norm)
    if not parallel.all_ranks_agree(finite):
        return False, grad_norm
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if opt.config.clip_grad > 0.0 and params and not getattr(opt, "is_stub_optimizer", False):
            clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, grad_norm,
                                         opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)  # fmt: skip
    optimizer.step_with_ready_grads()
    return True, grad_norm


def build_lr_scheduler(optimizer, trainer: TrainerConfig) -> OptimizerParamScheduler:
    """megatron-core's scheduler counting ``trainer.lr_unit`` (see :func:`lr_schedule_position`).

    ``lr(n) = lr * n / warmup_steps`` for ``n <= warmup_steps`` (from 0), then constant, or a
    ``linear``/``cosine`` decay to ``min_lr`` at ``n = lr_decay_steps`` (``lr_decay_style``).
    With ``lr_unit: rl_steps`` and ``warmup_steps: 10`` this is the paper's 10-step warm-up
    (arXiv 2607.10481, App. B) as its verl-based code runs it: a scheduler stepped once per RL
    step, ``lr * min(1, s / 10)`` for RL step ``s`` counted from 0.
    """
    constant = trainer.lr_decay_style == "constant"
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if trainer.warmup_steps > 0 else trainer.lr,
        max_lr=trainer.lr,
        min_lr=trainer.min_lr,
        lr_warmup_steps=trainer.warmup_steps,
        lr_decay_steps=_CONSTANT_HORIZON if constant else trainer.lr_decay_steps,
        lr_decay_style=trainer.lr_decay_style,
        start_wd=trainer.weight_decay,
        end_wd=trainer.weight_decay,
        wd_incr_steps=_CONSTANT_HORIZON,
        wd_incr_style="constant",
    )


def lr_schedule_position(updates_done: int, updates_per_step: int, unit: str) -> int:
    """The scheduler position for the next optimizer update.

    ``unit = "rl_steps"``: RL steps completed, ``updates_done // updates_per_step`` — every
    update of RL step ``s`` (from 0) uses ``lr(s)``. ``unit = "updates"``: the update's own
    1-based index, ``updates_done + 1`` — the LR moves on every update.
    """
    if unit == "rl_steps":
        return updates_done // updates_per_step
    if unit == "updates":
        return updates_done + 1
    raise ValueError(f"trainer.lr_unit={unit!r}: use rl_steps or updates")


def advance_lr_schedule(
    scheduler: OptimizerParamScheduler, updates_done: int, updates_per_step: int, unit: str
) -> None:
    """Move ``scheduler`` to the position of the next update (sets every group's LR)."""
    target = lr_schedule_position(updates_done, updates_per_step, unit)
    scheduler.step(increment=target - scheduler.num_steps)
