"""Trainer checkpoints: megatron-core ``dist_checkpointing`` plus per-rank run state.

Layout of ``path`` (the caller writes it inside a temporary directory and renames it, see
``orchestration/run/checkpoints.py``)::

    path/
      dist/            dist_checkpointing: model (``model``), reference weights (``reference.*``),
                       the behavior weights of a one-step-off batch in flight (``behavior.*``,
                       ``orchestration.async_rollout``, when kept), optimizer state (none if it
                       never stepped), LR scheduler, update counter
      rng/rank_R.pt    torch / CUDA / Python / NumPy RNG states of global rank R
      run_state.pt     the orchestrator's ``run_state`` dict (written by global rank 0)

Every file is read back with ``torch.load(weights_only=True)`` (megatron's ``common.pt``
too, torch's default), so a checkpoint cannot run code when it is loaded.

The model, the reference and the behavior weights (saved through the model's sharded state
dict, keys prefixed ``reference.`` / ``behavior.``) reshard over TP, PP, EP and DP. The
distributed optimizer's state is saved ``fully_reshardable`` (:data:`SAVE_FORMAT`): fp32
master weights and Adam moments per parameter, in the parameter's own shape and sharding, so
it reshards like the model; the writes of what the data-parallel ranks hold alike are spread
over them (docs/trainer.md, "Checkpoints", has the measurements against ``dp_reshardable``
and the other variants). A checkpoint saved ``dp_reshardable`` (one that records no
``optimizer_format``) is loaded in that format: over another DP size only, which
``orchestration/run/resume_check.py`` checks before anything starts. The layout a save was
made at is recorded as ``parallel_layout`` (read by ``config/resume_layout.py``). The
non-distributed optimizer saves per-parameter state, which reshards like the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import random
import signal
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from megatron_armor.config.resume_layout import (
    DP_RESHARDABLE,
    FULLY_RESHARDABLE,
    Layout,
    parse_layout,
)
from megatron_armor.trainer import parallel
from megatron_armor.trainer.hf_weights import unwrap
from megatron_armor.trainer.optimizer_state import (
    load_optimizer,
    materialize_optimizer_state,
    optimizer_metadata,
    optimizer_stepped,
    unshare_adam_steps,
)
from megatron_armor.trainer.weight_store import BEHAVIOR

REFERENCE_PREFIX = "reference."
BEHAVIOR_PREFIX = "behavior."


@dataclass(frozen=True)
class SaveFormat:
    """How a save writes the trainer state, and how a load reads it
    (``benchmarks/bench_checkpoint_formats.py`` measures the variants: docs/trainer.md)."""

    optimizer: str = FULLY_RESHARDABLE
    """The distributed optimizer's format (``FULLY_RESHARDABLE`` or ``DP_RESHARDABLE``;
    ignored by the non-distributed optimizer)."""
    gather_on_dp0: bool = False
    """``FULLY_RESHARDABLE``: gather the state over gloo on data-parallel rank 0 only
    (megatron-core's memory-efficient mode) instead of on every data-parallel rank."""
    parallel_io: bool = True
    """Spread the writes of a save of what the data-parallel ranks hold alike over those ranks,
    and the reads of a load (each rank reads a part, the parts are exchanged): megatron-core's
    fully parallel strategies. Without it data-parallel rank 0 writes all of it and every
    rank reads what it needs."""


SAVE_FORMAT = SaveFormat()
"""What :func:`save_trainer` writes and :func:`load_trainer` reads with."""
PR_SET_PDEATHSIG = 1
_writers_tied: list[int] = []  # the pid whose forks die with it (once per process)


def tie_writer_processes() -> None:
    """No process of megatron-core's checkpoint writer outlives this one, even SIGKILLed.

    Its torch_dist writer collects write results in a queue that by default lives in a
    ``multiprocessing`` *spawn* ``Manager`` (a server process, and the resource tracker with
    it): both stay after the trainer's process is killed, re-parented to init and deaf to
    SIGTERM (they inherit the actor's ignored stop signals). The save here is synchronous
    (``AsyncRequest.execute_sync``): the results are put and read in this process, so an
    in-process queue holds them: no helper process, the same files, no spawn start-up. The
    writer processes megatron-core forks per save get a parent-death SIGKILL."""
    if _writers_tied == [os.getpid()]:
        return
    if not hasattr(filesystem_async, "_results_queue"):  # a megatron-core without the global
        raise RuntimeError("megatron-core's filesystem_async._results_queue is gone: "
                           "tie_writer_processes needs updating for this version")  # fmt: skip
    filesystem_async._results_queue = queue.Queue()
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    forking = [0]  # the pid that forks, as the child sees it

    def remember_parent() -> None:
        forking[0] = os.getpid()

    def die_with_parent() -> None:  # in a forked child
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != forking[0]:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=remember_parent, after_in_child=die_with_parent)
    _writers_tied[:] = [os.getpid()]


def _detached_copy(sharded: dict) -> dict:
    """A copy of a sharded state dict whose tensors no longer alias the live parameters."""
    out = {}
    for k, v in sharded.items():
        if isinstance(v, dict):
            out[k] = _detached_copy(v)
        elif isinstance(v, ShardedBase) and isinstance(getattr(v, "data", None), torch.Tensor):
            v.data = v.data.detach().clone()
            out[k] = v
        else:
            out[k] = v
    return out


def _strip_prefix(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}


def current_layout() -> Layout:
    """This process's trainer layout (after ``parallel.init_parallel``)."""
    return Layout(parallel.tp_size(), parallel.pp_size(), parallel.ep_size(),
                  parallel.expert_tp_size(), parallel.dp_size())  # fmt: skip


def _sharded_state(
    trainer,
    is_loading: bool,
    with_optimizer: bool = True,
    with_behavior: bool = False,
    fmt: SaveFormat = SAVE_FORMAT,
) -> dict:
    """What :func:`save_trainer` writes; without the optimizer when it never stepped
    (:func:`optimizer_stepped`), recorded as ``optimizer_stepped``; the behavior weights
    with ``with_behavior`` (recorded as ``behavior_kept``); the distributed optimizer's state
    in ``fmt.optimizer``, recorded with the layout as ``parallel_layout``."""
    core = unwrap(trainer.model)
    model_sd = core.sharded_state_dict()
    with trainer.store.swapped("ref"):
        ref_sd = _detached_copy(core.sharded_state_dict(prefix=REFERENCE_PREFIX))
    distributed = bool(trainer.config.trainer.use_distributed_optimizer)
    state = {
        "model": model_sd,
        "reference": ref_sd,
        "scheduler": trainer.scheduler.state_dict(),
        "updates": trainer.updates,
        "optimizer_stepped": with_optimizer,
        "behavior_kept": with_behavior,
        "parallel_layout": {
            **current_layout().as_dict(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "distributed_optimizer": distributed,
            **({"optimizer_format": fmt.optimizer} if distributed else {}),
        },
    }
    if with_behavior:  # loading: the live tensors' shapes (the copy is made from the load)
        kept = trainer.store.has(BEHAVIOR)
        with trainer.store.swapped(BEHAVIOR) if kept else contextlib.nullcontext():
            state["behavior"] = _detached_copy(core.sharded_state_dict(prefix=BEHAVIOR_PREFIX))
    if with_optimizer:
        state["optimizer"] = trainer.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata=optimizer_metadata(distributed, fmt.optimizer, fmt.gather_on_dp0),
        )  # fmt: skip
    return state


def _rng_state() -> dict:
    """RNG states in types ``torch.load(weights_only=True)`` accepts (NumPy's key array as an
    int64 tensor)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), gauss))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _save_strategy(fmt: SaveFormat):
    """megatron-core's save strategy for ``fmt`` (``None``: its default)."""
    if not fmt.parallel_io:
        return None
    return FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), parallel.dp_group()
    )


def _load_strategy(fmt: SaveFormat, dist_dir: str):
    """megatron-core's load strategy for ``fmt`` and the checkpoint in ``dist_dir``."""
    default = get_default_load_sharded_strategy(dist_dir)
    if not fmt.parallel_io:
        return default
    return FullyParallelLoadStrategyWrapper(default, parallel.dp_group())


def save_trainer(trainer, path: str, run_state: dict, fmt: SaveFormat = SAVE_FORMAT) -> None:
    """Collectively write the trainer state and ``run_state`` under ``path`` (as ``fmt``
    says)."""
    rank = parallel.global_rank()
    os.makedirs(os.path.join(path, "dist"), exist_ok=True)
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    _barrier()
    stepped = optimizer_stepped(trainer.optimizer)
    behavior = trainer.store.has(BEHAVIOR)  # orchestration.async_rollout: one_step
    tie_writer_processes()
    state = _sharded_state(trainer, False, stepped, behavior, fmt)
    dist_checkpointing.save(state, os.path.join(path, "dist"), _save_strategy(fmt))
    torch.save(_rng_state(), os.path.join(path, "rng", f"rank_{rank}.pt"))
    if rank == 0:
        torch.save(run_state, os.path.join(path, "run_state.pt"))
    _barrier()


def load_trainer(trainer, path: str, fmt: SaveFormat = SAVE_FORMAT) -> dict:
    """Restore what :func:`save_trainer` wrote, at this process's layout (which may differ
    from the saved one: ``config/resume_layout.py``), reading as ``fmt.parallel_io`` says (the
    optimizer format is the saved one); returns the orchestrator's ``run_state``."""
    dist_dir = os.path.join(path, "dist")
    if not os.path.isdir(dist_dir):
        raise FileNotFoundError(f"{path!r} is not a trainer checkpoint (no dist/ directory)")
    common = dist_checkpointing.load_common_state_dict(dist_dir)
    saved = parse_layout(common)
    behavior = common.get("behavior_kept", False)
    if saved.optimizer_stepped:
        materialize_optimizer_state(trainer.optimizer)
    read = SaveFormat(saved.optimizer_format or DP_RESHARDABLE, parallel_io=fmt.parallel_io)
    state = _sharded_state(trainer, True, saved.optimizer_stepped, behavior, read)
    loaded = dist_checkpointing.load(state, dist_dir, _load_strategy(read, dist_dir))
    _restore_weights(trainer, loaded, behavior)
    if saved.optimizer_stepped:  # else the fresh optimizer is the saved one (no state)
        with torch.no_grad():  # the optimizer copies into views of parameters
            load_optimizer(trainer.optimizer, loaded["optimizer"], common["optimizer"],
                           read.optimizer)  # fmt: skip
        unshare_adam_steps(trainer.optimizer)
    trainer.scheduler.load_state_dict(loaded["scheduler"])
    trainer.updates = int(loaded["updates"])
    _restore_rng(path, same_layout=_same_ranks(common))
    return torch.load(os.path.join(path, "run_state.pt"), weights_only=True)


def _restore_weights(trainer, loaded: dict, behavior: bool) -> None:
    """The loaded model, reference and behavior weights into the live model and the store."""
    core = unwrap(trainer.model)
    # dist_checkpointing loads the model in place (its tensors are the live parameters), so
    # keep a copy before the reference passes through the live parameters
    model_state = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in loaded["model"].items()
    }
    core.load_state_dict(_strip_prefix(loaded["reference"], REFERENCE_PREFIX))
    trainer.store.snapshot("ref")
    if behavior:
        core.load_state_dict(_strip_prefix(loaded["behavior"], BEHAVIOR_PREFIX))
        trainer.store.snapshot(BEHAVIOR)
    else:  # a run without async rollout
        trainer.store.copies.pop(BEHAVIOR, None)
    core.load_state_dict(model_state)


def _same_ranks(common: dict) -> bool:
    """Whether the checkpoint was saved by ranks in the roles this process's ranks have (a
    save that records no world size: assumed so, as it was loaded before layouts changed)."""
    saved = common.get("parallel_layout") or {}
    if "world_size" not in saved:
        return True
    world = dist.get_world_size() if dist.is_initialized() else 1
    now = current_layout().as_dict()
    return saved.get("world_size") == world and all(saved.get(k) == v for k, v in now.items())


def _restore_rng(path: str, same_layout: bool) -> None:
    """Global rank R's RNG states from the save of rank R when the ranks keep their roles;
    after a layout change rank R is another shard, so it keeps the seeded states
    (``parallel.init_parallel``; the loss draws no random numbers: dropout is 0)."""
    rng_file = os.path.join(path, "rng", f"rank_{parallel.global_rank()}.pt")
    if same_layout and os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))
