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
- A finite update through ``guarded_step`` is megatron-core's own ``optimizer.step()`` (here a
  ``ChainedOptimizer``): the same calls in the same order (prepare, norm, clip by it, inner
  step), so two single-rank runs from the same weights, one each way, end with the same weights
  bit for bit, in fp32 (an ``FP32Optimizer`` inside) and bf16
  (``Float16OptimizerWithFloat16Params``, fp32 main params).

Run as a script it is one rank: ``python this_file.py guard RANK WORLD PORT MODEL_DIR BAD_DIR
OUT`` (the skip checks) or ``python this_file.py step plain|guarded PRECISION PORT MODEL_DIR
OUT`` (two finite updates one way).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_batch, make_models, perturb  # noqa: E402

from megatron_armor.trainer.ranks import run_rank_processes  # noqa: E402
from megatron_armor.net import free_port  # noqa: E402

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
    from megatron_armor.trainer.hf_weights import load_hf_weights
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(make_config(model_dir, world, "fp32"), rank, world, "127.0.0.1", port)
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


def make_config(model_dir: str, world: int, precision: str):
    from megatron_armor.config.schema import ArmorConfig

    cfg = ArmorConfig()
    t = cfg.trainer
    t.model_path, t.world_size, t.precision = model_dir, world, precision
    t.lr, t.warmup_steps, t.lr_unit, t.micro_batch_tokens = 1e-3, 0, "updates", 40
    cfg.algo.ratio, cfg.algo.group_size = "mixed", 4  # alpha 'auto': 3/4
    return cfg


def step_main(how: str, precision: str, port: int, model_dir: str, out: str) -> None:
    """Two finite updates with megatron-core's ``optimizer.step()`` (``plain``) or
    ``guarded_step`` (``guarded``); the weights and gradient norms after them."""
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer
    from megatron_armor.trainer.optim import guarded_step
    from megatron_armor.trainer.schedule import global_units, policy_loss_builder, run_schedule

    trainer = MegatronTrainer(make_config(model_dir, 1, precision), 0, 1, "127.0.0.1", port)
    try:
        batch = make_batch()
        old, ref, _ = trainer.step_logprobs(batch, with_ref=True, shared=True)
        batch.old_logprobs, batch.ref_logprobs = old, perturb(ref, batch.loss_mask, 2, 0.3)
        norms = []
        for _ in range(2):
            mbs = trainer._micro_batches(batch)
            units = global_units(mbs, "token-mean")
            trainer.model.train()
            trainer.model.zero_grad_buffer()
            trainer.optimizer.zero_grad()
            run_schedule(trainer.model, mbs, policy_loss_builder(trainer.lp, trainer.loss_settings,
                                                                 units), forward_only=False)  # fmt: skip
            if how == "plain":
                norms.append(float(trainer.optimizer.step()[1]))
            else:
                norms.append(guarded_step(trainer.optimizer, True)[1])
        inner = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
        kind = sorted({type(o).__name__ for o in inner})
        torch.save({"weights": weights(trainer), "norms": norms, "optimizer": kind}, out)
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
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    commands = [[sys.executable, __file__, "guard", str(r), "2", str(port), model_dir, bad_dir,
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_finite_guarded_step_is_megatrons_step_bit_for_bit(tmp_path, precision) -> None:
    model_dir = make_models(str(tmp_path / "models"))["qwen2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    ways = ("plain", "guarded")
    commands = [[sys.executable, __file__, "step", how, precision, str(free_port()), model_dir,
                 str(tmp_path / f"{how}.pt")] for how in ways]  # fmt: skip
    run_rank_processes(commands, [str(tmp_path / f"{how}.txt") for how in ways], env, 280)
    plain, guarded = (torch.load(tmp_path / f"{how}.pt", weights_only=False) for how in ways)
    kind = [{"fp32": "FP32Optimizer", "bf16": "Float16OptimizerWithFloat16Params"}[precision]]
    assert plain["optimizer"] == guarded["optimizer"] == kind
    assert plain["norms"] == guarded["norms"] and all(n > 0 for n in plain["norms"])
    assert sorted(plain["weights"]) == sorted(guarded["weights"])
    assert all(torch.equal(w, guarded["weights"][n]) for n, w in plain["weights"].items())


if __name__ == "__main__":
    if sys.argv[1] == "step":
        step_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:7])
    else:
        rank, world, port = (int(x) for x in sys.argv[2:5])
        rank_main(rank, world, port, *sys.argv[5:8])
