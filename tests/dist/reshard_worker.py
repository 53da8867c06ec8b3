"""One trainer rank of the resume-at-another-layout dist test (run as a script, one per rank).

``python reshard_worker.py MODE RANK WORLD PORT OUT MODEL_DIR TP PP EP ETP SAVED``

A ``MegatronTrainer`` with the distributed optimizer (fp32) on ``MODEL_DIR`` (the tiny Qwen2,
or the tiny Qwen3-MoE with its load-balancing loss off) at ``trainer.tp / pp / ep / etp``; the
rest of the world is data parallel.

- ``save``: two ARMOR updates, with the live weights kept as the ``behavior`` copy between
  them (``snapshot_behavior``, as a one-step-off batch in flight keeps them), so policy,
  reference and behavior weights all differ; the checkpoint ``OUT/ckpt``; what it holds (the
  three weight sets as HF tensors, the gathered optimizer state); then the run continued at
  this layout: two more updates, the gathered optimizer state after the first of them.
- ``load``: a fresh trainer at its own layout loads ``SAVED/ckpt`` (``SAVED``: the ``OUT`` of a
  ``save`` run): what it holds, then the same two updates.

Each rank writes ``OUT/MODE_rank{RANK}.pt``; :func:`held` and :func:`adam_state` are
collective and return tensors on every rank (the export rank's HF dict is the whole one).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_batch, perturb  # noqa: E402
from trainer_worker import full, make_config  # noqa: E402

ADAM_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The distributed optimizer's per-parameter state: fp32 master weights and Adam moments."""


def config(model_dir: str, world: int, tp: int, pp: int, ep: int, etp: int):
    cfg = make_config(model_dir, tp, pp, world, distopt=True)
    t = cfg.trainer
    t.ep, t.etp = ep, etp
    t.moe.aux_loss_coeff = 0.0  # per micro-batch: it would depend on the data-parallel split
    return cfg


def adam_state(trainer) -> dict:
    """The whole optimizer state as HF tensors, whatever the layout: each parameter's slice
    of ``ADAM_KEYS`` that this data-parallel rank owns, summed with the other ranks' (every
    element is owned by one rank, so the sum is exact) into the parameter's shape, then
    exported like weights (gathered over TP, PP and EP); and the Adam ``step``."""
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    owned = {p: opt for opt in optimizers for buf in opt.buffers for p in buf.param_index_map}
    out: dict = {}
    for key in ADAM_KEYS:
        values = {}
        for name, param in trainer.model.named_parameters():
            opt, flat = owned[param], torch.zeros(param.numel())
            if param in opt.model_param_gbuf_map:  # else none of it is on this DP rank
                part = opt._get_model_param_range_map(param)["param"]
                flat[part.start : part.end] = opt._get_main_param_and_optimizer_states(param)[key]
            dist.all_reduce(flat, group=opt.data_parallel_group)
            values[name] = flat.view_as(param)
        trainer.store.load_into(f"adam/{key}", values)
        out[key] = dict(trainer.export_weights(f"adam/{key}"))
        trainer.store.copies.pop(f"adam/{key}")
    steps = {float(s["step"]) for opt in optimizers for s in opt.optimizer.state.values()}
    out["step"] = sorted(steps)
    return out


def held(trainer) -> dict:
    """What a checkpoint holds, gathered: policy, reference and behavior weights, the optimizer
    state, the update count and the LR scheduler's position."""
    return {
        "policy": dict(trainer.export_weights("policy")),
        "ref": dict(trainer.export_weights("ref")),
        "behavior": dict(trainer.export_weights("behavior")),
        "adam": adam_state(trainer),
        "updates": trainer.updates,
        "lr_steps": trainer.scheduler.num_steps,
    }


def continue_run(trainer, batch, out: dict) -> None:
    """The two updates after the checkpoint: metrics, then the state after the first."""
    out["m3"] = trainer.train_step(batch, 1)
    out["after_m3"] = {"adam": adam_state(trainer), "policy": dict(trainer.export_weights())}
    out["m4"] = trainer.train_step(batch, 1)


def save(trainer, out: dict, saved_dir: str) -> None:
    batch = make_batch()
    lp0 = full(trainer.compute_logprobs(batch, "policy"))
    batch.old_logprobs = perturb(lp0, batch.loss_mask, 1, 0.3)
    batch.ref_logprobs = perturb(lp0, batch.loss_mask, 2, 0.3)
    out["m1"] = trainer.train_step(batch, 1)
    trainer.snapshot_behavior()
    out["m2"] = trainer.train_step(batch, 1)
    state = {"step": 2, "old": batch.old_logprobs, "ref": batch.ref_logprobs}
    trainer.save_checkpoint(os.path.join(saved_dir, "ckpt"), state)
    out["held"] = held(trainer)
    continue_run(trainer, batch, out)


def load(trainer, out: dict, saved_dir: str) -> None:
    state = trainer.load_checkpoint(os.path.join(saved_dir, "ckpt"))
    batch = make_batch()
    batch.old_logprobs, batch.ref_logprobs = state["old"], state["ref"]
    out["held"] = held(trainer)
    continue_run(trainer, batch, out)


if __name__ == "__main__":
    mode, rank, world, port, out_dir, model_dir = sys.argv[1:7]
    rank, world = int(rank), int(world)
    tp, pp, ep, etp = (int(n) for n in sys.argv[7:11])
    saved_dir = sys.argv[11]
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(
        config(model_dir, world, tp, pp, ep, etp), rank, world, "127.0.0.1", int(port)
    )
    result: dict = {}
    {"save": save, "load": load}[mode](trainer, result, saved_dir)
    torch.save(result, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    trainer.close()
