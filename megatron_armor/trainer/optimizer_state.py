"""The optimizer's part of a trainer checkpoint: megatron-core's sharded state dict of it, and
its load (``trainer/checkpoint.py`` calls these).

The distributed optimizer's state is saved :data:`~megatron_armor.config.resume_layout.FULLY_RESHARDABLE`
(per parameter, reshards to any layout) or, by older saves, ``dp_reshardable`` (the flat
buffers of one model-parallel layout). Three megatron-core 0.16.1 details are handled here:
a distributed optimizer that never stepped has no Adam state to load into (it is created
first); without TE or Apex (the CPU path) torch Adam keeps a ``step`` tensor in each
parameter's state, which megatron restores shared across parameters (un-shared after the load)
and which its ``fully_reshardable`` load does not expect (set aside meanwhile); a
``fully_reshardable`` save's optimizer parameter groups follow its layout's chain of optimizers
(a MoE model has a separate expert optimizer only at ``ep > 1``), so the load takes the live
optimizer's groups with the saved Adam step.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_armor.config.resume_layout import FULLY_RESHARDABLE


def optimizer_metadata(distributed: bool, optimizer_format: str, gather_on_dp0: bool) -> dict:
    """megatron-core's ``sharded_state_dict`` metadata. The distributed optimizer's state in
    ``optimizer_format`` (with ``gather_on_dp0``: ``fully_reshardable`` state gathered on
    data-parallel rank 0 only); the keys of a chained optimizer's (a MoE model's dense and
    expert optimizers) reshardable state are the parameters' own, without the ``chained_N.``
    prefix: the chain's length depends on the layout. The non-distributed optimizer: megatron's
    defaults (``chained_N.`` prefixes), as its checkpoints have always been written."""
    if not distributed:
        return {}
    return {
        "distrib_optim_sharding_type": optimizer_format,
        "chained_optim_avoid_prefix": True,
        "distrib_optim_fully_reshardable_mem_efficient": gather_on_dp0,
    }


def optimizer_stepped(optimizer) -> bool:
    """Whether the optimizer took a step (its Adam states exist). One that never did (every
    update so far skipped as non-finite, docs/trainer.md) has nothing to save: a fresh
    optimizer is the same. Every rank answers alike (ranks step together)."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(getattr(o, "optimizer", o).state) for o in opts)


def materialize_optimizer_state(optimizer) -> None:
    """A distributed optimizer that has not stepped yet has no Adam state (``step``,
    ``exp_avg``...) to load into; megatron's own zero-gradient dummy step creates it (the values
    are overwritten by the load)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def unshare_adam_steps(optimizer) -> None:
    """Without TE/Apex, megatron's distributed optimizer restores one ``step`` tensor shared
    by every parameter's Adam state; torch Adam increments each state's ``step`` in place, so a
    shared tensor would advance once per parameter and corrupt the bias correction. Give every
    state its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _chain(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _sub_states(state: dict, chained: int | None = None) -> list[dict]:
    """Each chained optimizer's part of an optimizer state dict: a chain of one keeps its
    state as that optimizer's, a longer one as ``{index: state}``. ``chained``: the length of
    the chain the dict was made for (``None``: read it from the keys)."""
    if chained is None:
        chained = sum(isinstance(k, int) for k in state) or 1
    return [state] if chained == 1 else [state[i] for i in range(chained)]


def _saved_step_and_scaler(saved: dict) -> tuple[float | None, dict | None]:
    """The Adam step and the fp16 loss scaler state of a save's optimizer common state (every
    optimizer of a chain steps together: megatron-core synchronises their steps)."""
    steps, scaler = set(), None
    for sub in _sub_states(saved):
        steps.update(g["step"] for g in sub["optimizer"]["param_groups"] if "step" in g)
        scaler = scaler or sub.get("grad_scaler")
    if len(steps) > 1:
        raise ValueError(f"the saved optimizers record different Adam steps: {sorted(steps)}")
    return (steps.pop() if steps else None), scaler


def load_optimizer(optimizer, loaded: dict, saved_common: dict, optimizer_format: str) -> None:
    """Load the optimizer state ``dist_checkpointing`` read (``loaded``; ``saved_common``: the
    save's ``common.pt`` part of it) into ``optimizer``: :func:`_load_fully_reshardable`, or
    megatron-core's ``load_state_dict`` (the non-distributed optimizer, ``dp_reshardable``)."""
    if optimizer_format == FULLY_RESHARDABLE:
        _load_fully_reshardable(optimizer, loaded, saved_common)
        return
    optimizer.load_state_dict(loaded)
    chain = _chain(optimizer)
    for opt, part in zip(chain, _sub_states(loaded, len(chain)), strict=True):
        if isinstance(opt, DistributedOptimizer):
            _restore_saved_step(opt, part["optimizer"]["param_groups"])


def _restore_saved_step(opt: DistributedOptimizer, groups: list[dict]) -> None:
    """The saved Adam ``step`` in every parameter's torch Adam state (no TE or Apex: the CPU
    path). megatron-core 0.16.1's ``dp_reshardable`` load sets it from the saved groups, then
    copies over it the ``step`` the optimizer held when the load was prepared (1 after the
    dummy step of :func:`materialize_optimizer_state`): a resume after more than one update
    would restart Adam's bias correction."""
    steps = {g["step"] for g in groups if "step" in g}
    if len(steps) != 1:
        return  # the groups record no step (TE, Apex: it is not in the state either)
    step = torch.tensor(float(steps.pop()))
    for state in opt.optimizer.state.values():
        if "step" in state:
            state["step"] = step.clone()


def _load_fully_reshardable(optimizer, loaded: dict, saved_common: dict) -> None:
    """A :data:`FULLY_RESHARDABLE` save: each parameter's state is this layout's slice of the
    saved one; the parameter groups are the live optimizer's (the config's hyper-parameters:
    the save's groups follow its layout's chain of optimizers, e.g. a separate expert
    optimizer only at ``ep > 1``) with the saved Adam ``step``. megatron-core 0.16.1 copies
    each key of the parameter state into the optimizer's state and fails (``KeyError:
    'step'``) where torch Adam keeps ``step`` there (no TE or Apex: the CPU path), so ``step``
    is set aside meanwhile and restored from the groups."""
    step, scaler = _saved_step_and_scaler(saved_common)
    chain = _chain(optimizer)
    for opt, part in zip(chain, _sub_states(loaded, len(chain)), strict=True):
        groups = opt.state_dict()
        for group in groups["optimizer"]["param_groups"]:
            group["step"] = step
        if scaler is not None:
            groups["grad_scaler"] = scaler
        opt.load_state_dict(groups)
        inner = opt.optimizer.state
        set_aside = {p: s.pop("step") for p, s in inner.items() if "step" in s}
        try:
            opt.load_parameter_state_from_fully_reshardable(part["param_state"])
        finally:
            for p, value in set_aside.items():
                inner[p]["step"] = value
