"""Dist tier: the non-finite guard on two data-parallel megatron-core ranks (gloo, CPU).

- An update whose loss is not finite on ONE rank (the other's is) is skipped on both: no
  optimizer step (Adam has no state yet), the weights as they were bit for bit on each rank,
  ``train/skipped`` 1 on both, and its place in the LR schedule kept (the update counter
  moves on).
- An update over a mini-batch with one NaN advantage (one sample: one rank's share, whose
  loss is NaN; the gradients all-reduced over DP are NaN on both) is skipped on both.
- The next finite update is applied on both ranks alike (the same weights on each), with a
  finite gradient norm.
- Weights with a NaN in one HF tensor are refused by the load, naming that tensor.

Run as a script (``python this_file.py RANK WORLD PORT MODEL_DIR BAD_DIR OUT``) it is one rank.
"""

from __future__ import annotations

import math
import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_batch, make_models, perturb  # noqa: E402

from megatron_armor.trainer.ranks import run_rank_processes  # noqa: E402

pytestmark = pytest.mark.dist

POISONED_TENSOR = "model.layers.1.mlp.down_proj.weight"


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def adam_steps(trainer) -> int:
    """How many Adam states the optimizer holds (none before its first step)."""
    opts = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return sum(len(o.optimizer.state) for o in opts)


def loss_only_on_one_rank(trainer, batch, rank: int) -> dict:
    """Forward-backward with finite losses, then the guarded step told rank 1's loss is not:
    both ranks must skip."""
    from megatron_armor.trainer.optim import guarded_step
    from megatron_armor.trainer.schedule import global_units, policy_loss_builder, run_schedule

    mbs = trainer._micro_batches(batch)
    builder = policy_loss_builder(
        trainer.lp, trainer.loss_settings, global_units(mbs, "token-mean")
    )
    trainer.model.train()
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    run_schedule(trainer.model, mbs, builder, forward_only=False)
    before = weights(trainer)
    applied, norm = guarded_step(trainer.optimizer, loss_is_finite=rank == 0)
    return {"applied": applied, "norm": norm, "unchanged": same(before, weights(trainer))}


def poisoned_update(trainer, batch) -> dict:
    poisoned = batch.select(list(range(batch.num_samples)))
    first = batch.cu_seqlens[0].item(), batch.cu_seqlens[1].item()
    poisoned.advantages[first[0] : first[1]] = math.nan  # sample 0: one rank's share
    before, updates = weights(trainer), trainer.updates
    metrics = trainer._update(poisoned)
    return {"metrics": metrics, "unchanged": same(before, weights(trainer)),
            "counted": trainer.updates == updates + 1, "adam": adam_steps(trainer)}  # fmt: skip


def rank_main(rank: int, world: int, port: int, model_dir: str, bad_dir: str, out: str) -> None:
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.hf_weights import load_hf_weights
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    cfg = ArmorConfig()
    t = cfg.trainer
    t.model_path, t.world_size, t.precision = model_dir, world, "fp32"
    t.lr, t.warmup_steps, t.lr_unit, t.micro_batch_tokens = 1e-3, 0, "updates", 40
    cfg.algo.ratio, cfg.algo.group_size, cfg.algo.alpha = "mixed", 4, 3 / 4
    trainer = MegatronTrainer(cfg, rank, world, "127.0.0.1", port)
    try:
        batch = make_batch()
        old, ref, _ = trainer.step_logprobs(batch, with_ref=True, shared=True)
        batch.old_logprobs, batch.ref_logprobs = old, perturb(ref, batch.loss_mask, 2, 0.3)
        result = {"one_rank": loss_only_on_one_rank(trainer, batch, rank),
                  "poisoned": poisoned_update(trainer, batch)}  # fmt: skip
        before = weights(trainer)
        clean = trainer._update(batch)
        result["clean"] = {"metrics": clean, "changed": not same(before, weights(trainer)),
                           "weights": weights(trainer), "adam": adam_steps(trainer)}  # fmt: skip
        try:
            load_hf_weights(trainer.model, bad_dir, trainer.spec)
            result["refused"] = None
        except ValueError as err:
            result["refused"] = str(err)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        trainer.close()


def poison(model_dir: str, out_dir: str) -> str:
    """A copy of ``model_dir`` whose :data:`POISONED_TENSOR` has one NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors[POISONED_TENSOR][3, 5] = math.nan
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


@pytest.mark.timeout(300)
def test_a_non_finite_update_is_skipped_on_every_rank(tmp_path) -> None:
    model_dir = make_models(str(tmp_path / "models"))["qwen2"]
    bad_dir = poison(model_dir, str(tmp_path / "poisoned"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    commands = [[sys.executable, __file__, str(r), "2", str(port), model_dir, bad_dir,
                 str(tmp_path)] for r in range(2)]  # fmt: skip
    logs = [str(tmp_path / f"log{r}.txt") for r in range(2)]
    run_rank_processes(commands, logs, env, 280)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for got in ranks:
        one = got["one_rank"]
        assert not one["applied"] and one["unchanged"] and math.isfinite(one["norm"])
        p = got["poisoned"]
        assert p["metrics"]["train/skipped"] == 1.0 and p["unchanged"] and p["counted"]
        assert math.isnan(p["metrics"]["loss/grad_norm"]) and p["adam"] == 0
        c = got["clean"]
        assert c["metrics"]["train/skipped"] == 0.0 and c["changed"] and c["adam"] > 0
        assert math.isfinite(c["metrics"]["loss/grad_norm"])
        assert POISONED_TENSOR in got["refused"] and "non-finite" in got["refused"]
    # the rank whose share held the NaN sample logged a NaN loss; both skipped alike
    assert any(math.isnan(g["poisoned"]["metrics"]["loss/objective"]) for g in ranks)
    assert all(torch.equal(ranks[0]["clean"]["weights"][n], w)
               for n, w in ranks[1]["clean"]["weights"].items())  # fmt: skip


if __name__ == "__main__":
    rank, world, port = (int(x) for x in sys.argv[1:4])
    rank_main(rank, world, port, *sys.argv[4:7])
