"""One trainer rank of the mixture-of-experts dist tests (run as a script, one per rank).

``python moe_worker.py MODE RANK WORLD PORT OUT MODEL_DIR TP EP ETP``

- ``run``: a ``MegatronTrainer`` on the tiny Qwen3-MoE with ``trainer.tp / ep / etp = TP / EP /
  ETP`` (the rest of the world is data parallel; sequence parallelism with ``TP > 1``), built
  with a load-balancing loss: logits on fixed tokens, the
  exported HF tensors right after the import, policy log-probs, two ARMOR updates with the
  loss's coefficient at 0 (the Switch loss is taken per micro-batch, so with it on the
  gradients depend on how the ranks split the batch) and a checkpoint after the first, the
  exported weights after each, then a third update with the loss on.
- ``resume``: a fresh trainer loads ``OUT/ckpt``: its exported weights, then the second update
  again.
- ``forward``: the logits, the export and the policy log-probs of ``run`` only (no update: with
  ``TP > 1`` megatron-core trains MoE layers only with sequence parallelism, which the CPU
  path lacks; the forward passes run without it).

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


def moe_config(model_dir: str, world: int, tp: int, ep: int, etp: int):
    cfg = make_config(model_dir, tp, 1, world, False)
    cfg.trainer.ep, cfg.trainer.etp = ep, etp  # the layout under test, not etp's auto
    cfg.trainer.moe.aux_loss_coeff = AUX_LOSS_COEFF
    return cfg


def logits(trainer) -> torch.Tensor:
    """Logits of the oracle tokens, gathered over the TP ranks' vocabulary shards."""
    from megatron_armor.trainer import parallel
    from megatron_armor.trainer.schedule import run_schedule

    trainer.model.eval()
    with torch.no_grad():
        outputs = run_schedule(trainer.model, [oracle_micro_batch()], keep_logits, True)
    shard = outputs[0]["logits"]
    parts = [torch.empty_like(shard) for _ in range(parallel.tp_size())]
    dist.all_gather(parts, shard.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim=-1)[..., :VOCAB]


def forward(trainer, out: dict, out_dir: str) -> None:
    out["logits"] = logits(trainer)
    out["export0"] = dict(trainer.export_weights())
    out["lp0"] = full(trainer.compute_logprobs(make_batch(), "policy"))


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
    mode, rank, world, port, out_dir, model_dir = sys.argv[1:7]
    rank, world = int(rank), int(world)
    tp, ep, etp = (int(n) for n in sys.argv[7:10])
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    config = moe_config(model_dir, world, tp, ep, etp)
    trainer = MegatronTrainer(config, rank, world, "127.0.0.1", int(port))
    result: dict = {"ep_rank": dist.get_rank()}
    {"run": run, "resume": resume, "forward": forward}[mode](trainer, result, out_dir)
    torch.save(result, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    trainer.close()
