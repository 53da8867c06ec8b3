"""One trainer rank of the mixture-of-experts dist tests (run as a script, one per rank).

``python moe_worker.py MODE RANK WORLD PORT OUT MODEL_DIR EP``

- ``run``: a ``MegatronTrainer`` on the tiny Qwen3-MoE with ``trainer.ep = EP`` (the rest of
  the world is data parallel), built with a load-balancing loss: logits on fixed tokens, the
  exported HF tensors right after the import, policy log-probs, two ARMOR updates with the
  loss's coefficient at 0 (the Switch loss is taken per micro-batch, so with it on the
  gradients depend on how the ranks split the batch) and a checkpoint after the first, the
  exported weights after each, then a third update with the loss on.
- ``resume``: a fresh trainer loads ``OUT/ckpt``: its exported weights, then the second update
  again.

Each rank writes ``OUT/MODE_rank{RANK}.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import VOCAB, make_batch, perturb  # noqa: E402
from trainer_worker import full, keep_logits, make_config, oracle_micro_batch  # noqa: E402

AUX_LOSS_COEFF = 0.1


def moe_config(model_dir: str, ep: int, world: int):
    cfg = make_config(model_dir, 1, 1, world, False)
    cfg.trainer.ep = ep
    cfg.trainer.moe.aux_loss_coeff = AUX_LOSS_COEFF
    return cfg


def logits(trainer) -> torch.Tensor:
    """Logits of the oracle tokens (TP = 1: the last stage holds the whole vocabulary)."""
    from megatron_armor.trainer.schedule import run_schedule

    trainer.model.eval()
    with torch.no_grad():
        outputs = run_schedule(trainer.model, [oracle_micro_batch()], keep_logits, True)
    return outputs[0]["logits"][..., :VOCAB]


def run(trainer, out: dict, out_dir: str) -> None:
    out["logits"] = logits(trainer)
    out["export0"] = dict(trainer.export_weights())
    batch = make_batch()
    lp0 = full(trainer.compute_logprobs(batch, "policy"))
    batch.old_logprobs = perturb(lp0, batch.loss_mask, 1, 0.3)
    batch.ref_logprobs = perturb(lp0, batch.loss_mask, 2, 0.3)
    out["lp0"] = lp0
    trainer.config.trainer.moe.aux_loss_coeff = 0.0
    out["m1"] = trainer.train_step(batch, 1)
    out["w1"] = dict(trainer.export_weights())
    state = {"step": 1, "old": batch.old_logprobs, "ref": batch.ref_logprobs}
    trainer.save_checkpoint(os.path.join(out_dir, "ckpt"), state)
    out["m2"] = trainer.train_step(batch, 1)
    out["w2"] = dict(trainer.export_weights())
    trainer.config.trainer.moe.aux_loss_coeff = AUX_LOSS_COEFF
    out["m3"] = trainer.train_step(batch, 1)


def resume(trainer, out: dict, out_dir: str) -> None:
    state = trainer.load_checkpoint(os.path.join(out_dir, "ckpt"))
    out["w1"] = dict(trainer.export_weights())
    batch = make_batch()
    batch.old_logprobs, batch.ref_logprobs = state["old"], state["ref"]
    trainer.config.trainer.moe.aux_loss_coeff = 0.0
    out["m2"] = trainer.train_step(batch, 1)
    out["w2"] = dict(trainer.export_weights())


if __name__ == "__main__":
    mode, rank, world, port, out_dir, model_dir, ep = sys.argv[1:8]
    rank, world, ep = int(rank), int(world), int(ep)
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(moe_config(model_dir, ep, world), rank, world, "127.0.0.1", int(port))
    result: dict = {"ep_rank": dist.get_rank()}
    (run if mode == "run" else resume)(trainer, result, out_dir)
    torch.save(result, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    trainer.close()
