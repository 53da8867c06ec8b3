"""One trainer rank for the dist tests (run as a script, one process per rank).

``python trainer_worker.py MODE RANK WORLD PORT OUT MODELS TP PP DISTOPT EXTRAS``

- ``run``: (1) a ``MegatronTrainer`` on the tiny Qwen2: policy log-probs, two ARMOR updates
  (with a checkpoint after the first when EXTRAS has ``ckpt``, twice: as saves write it and as
  they wrote it before layout changes, and the train state offloaded
  between them when it has ``offload``), reference log-probs
  before/after ``reset_reference``, exported weights; (2) when EXTRAS has ``oracle``, for each
  tiny model, logits on fixed tokens (TP-gathered) and the exported HF tensors.
- ``resume``: a fresh trainer loads ``OUT/ckpt`` and takes the second update again; then,
  when the run wrote it, the same from ``OUT/ckpt_dp`` (a checkpoint as saves wrote it before
  the layout could change on resume: ``dp_reshardable``).
- ``oracle``: only (2), e.g. at ``TP > num_key_value_heads`` (KV heads replicated).

Each rank writes ``OUT/MODE_rank{RANK}.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import VOCAB, make_batch, oracle_tokens, perturb  # noqa: E402


def make_config(model_dir: str, tp: int, pp: int, world: int, distopt: bool):
    from megatron_armor.config.schema import ArmorConfig

    cfg = ArmorConfig()
    t = cfg.trainer
    t.model_path, t.tp, t.pp, t.world_size = model_dir, tp, pp, world
    t.precision, t.lr, t.warmup_steps, t.grad_clip = "fp32", 1e-3, 2, 1.0
    t.lr_unit = "updates"  # each train_step call is one update here, not an RL step
    t.micro_batch_tokens, t.use_distributed_optimizer, t.logprob_chunk = 40, distopt, 16
    cfg.algo.ratio, cfg.algo.group_size, cfg.algo.loss_agg = "mixed", 4, "token-mean"  # alpha 3/4
    cfg.rollout.sampling.temperature = 0.9
    return cfg


def full(tensor):
    """Sum of the reporting ranks' per-token results, on every rank."""
    local = tensor if tensor is not None else torch.zeros(make_batch().num_tokens)
    local = local.clone()
    dist.all_reduce(local)
    return local


def oracle_micro_batch():
    """The oracle tokens as one micro-batch (two rows)."""
    from megatron_armor.trainer.batching import build_micro_batch
    from megatron_armor.types import TrainBatch

    tokens = oracle_tokens()
    n, seq = tokens.shape
    zeros = torch.zeros(n * seq)
    batch = TrainBatch(
        tokens=tokens.reshape(-1),
        position_ids=torch.arange(seq).repeat(n),
        cu_seqlens=torch.arange(0, n * seq + 1, seq, dtype=torch.int32),
        sample_index=torch.arange(n).repeat_interleave(seq),
        token_data={"loss_mask": zeros, "is_anchor": zeros.bool()},
    )
    return build_micro_batch(batch, list(range(n)))


def keep_logits(mb, output):
    """A ``loss_func`` builder that hands the last stage's logits back."""
    return output.new_zeros(()), torch.tensor(0, dtype=torch.int), {"logits": output}


def oracle(models: dict[str, str]) -> dict:
    from megatron_armor.config.schema import TrainerConfig
    from megatron_armor.trainer import hf_weights, parallel
    from megatron_armor.trainer.model import build_model, read_hf_spec
    from megatron_armor.trainer.schedule import run_schedule

    out = {}
    for name, model_dir in models.items():
        spec = read_hf_spec(model_dir)
        model = build_model(spec, TrainerConfig(precision="fp32"))
        hf_weights.load_hf_weights(model, model_dir, spec)
        with torch.no_grad():
            outputs = run_schedule(model, [oracle_micro_batch()], keep_logits, forward_only=True)
        if parallel.is_last_stage():
            logits = outputs[0]["logits"]
            parts = [torch.empty_like(logits) for _ in range(parallel.tp_size())]
            dist.all_gather(parts, logits.contiguous(), group=parallel.tp_group())
            out[f"logits/{name}"] = torch.cat(parts, dim=-1)[..., :VOCAB]
        out[f"export/{name}"] = dict(hf_weights.export_hf_weights(model, spec))
    return out


def run(trainer, out: dict, ckpt: bool, offload: bool = False) -> None:
    batch = make_batch()
    lp0 = full(trainer.compute_logprobs(batch, "policy"))
    batch.old_logprobs = perturb(lp0, batch.loss_mask, 1, 0.3)
    batch.ref_logprobs = perturb(lp0, batch.loss_mask, 2, 0.3)
    out["lp0"] = lp0
    out["kl0"] = trainer.exact_kl(batch)  # policy == reference: zero
    out["m1"] = trainer.train_step(batch, 1)
    out["w1"] = dict(trainer.export_weights())
    if ckpt:
        state = {"step": 1, "old": batch.old_logprobs, "ref": batch.ref_logprobs}
        trainer.save_checkpoint(os.path.join(OUT, "ckpt"), state)
        save_as_before_layout_changes(trainer, os.path.join(OUT, "ckpt_dp"), state)
    if offload:  # as between colocated rollouts: log-probs run on the weights alone
        out["lp1"] = full(trainer.compute_logprobs(batch, "policy"))
        out["grad_bytes"] = trainer.offloader.grad_bytes_resident()
        trainer.offload_train_state()
        out["grad_bytes_offloaded"] = trainer.offloader.grad_bytes_resident()
        out["lp_offloaded"] = full(trainer.compute_logprobs(batch, "policy"))
    out["m2"] = trainer.train_step(batch, 1)
    out["w2"] = dict(trainer.export_weights())
    out["lp_policy"] = full(trainer.compute_logprobs(batch, "policy"))
    out["lp_ref"] = full(trainer.compute_logprobs(batch, "ref"))
    # the loop's call: every rank gets the whole log-probs (it keeps the batch for the update)
    out[f"shared/{dist.get_rank()}"] = trainer.step_logprobs(batch, True, None, shared=True)[:2]
    out["kl2"] = trainer.exact_kl(batch)
    # the loop's diagnostic without reference log-probs: a reference pass over its samples only
    from megatron_armor.orchestration.step.step_metrics import exact_kl_batch, exact_kl_mask

    mask = exact_kl_mask(batch, 3, 4)
    out["kl2_diag"] = trainer.step_logprobs(batch, False, mask, shared=True)[2]
    out["kl2_diag_plain"] = trainer.exact_kl(exact_kl_batch(batch, 3, 4))
    trainer.reset_reference()
    out["lp_ref_after_reset"] = full(trainer.compute_logprobs(batch, "ref"))
    out["kl_reset"] = trainer.exact_kl(batch)


def save_as_before_layout_changes(trainer, path: str, state: dict) -> None:
    """The checkpoint a save made before the layout could change on resume: the distributed
    optimizer's state ``dp_reshardable``, a ``parallel_layout`` without ``dp``,
    ``world_size`` and ``optimizer_format``."""
    from megatron_armor.config.resume_layout import DP_RESHARDABLE
    from megatron_armor.trainer.checkpoint import SaveFormat, save_trainer

    save_trainer(trainer, path, state, SaveFormat(DP_RESHARDABLE, parallel_io=False))
    if dist.get_rank() == 0:
        common_file = os.path.join(path, "dist", "common.pt")
        common = torch.load(common_file, weights_only=True)
        for key in ("dp", "world_size", "optimizer_format"):
            del common["parallel_layout"][key]
        torch.save(common, common_file)
    dist.barrier()


def resume(trainer, out: dict) -> None:
    """The second update from ``ckpt``, then again from ``ckpt_dp`` (as saved before layout
    changes) when the run wrote it."""
    for name, suffix in (("ckpt", ""), ("ckpt_dp", "_dp")):
        if not os.path.isdir(os.path.join(OUT, name)):
            continue
        state = trainer.load_checkpoint(os.path.join(OUT, name))
        batch = make_batch()
        batch.old_logprobs, batch.ref_logprobs = state["old"], state["ref"]
        out["step"] = state["step"]
        out[f"m2{suffix}"] = trainer.train_step(batch, 1)
        out[f"w2{suffix}"] = dict(trainer.export_weights())


if __name__ == "__main__":
    mode, rank, world, port, OUT, models_root = sys.argv[1:7]
    tp, pp, distopt = int(sys.argv[7]), int(sys.argv[8]), sys.argv[9] == "1"
    extras = sys.argv[10].split(",")
    rank, world = int(rank), int(world)
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    models = {n: os.path.join(models_root, n) for n in ("qwen2", "qwen3", "llama")}
    trainer = MegatronTrainer(
        make_config(models["qwen2"], tp, pp, world, distopt), rank, world, "127.0.0.1", int(port)
    )
    result: dict = {}
    if mode == "run":
        run(trainer, result, "ckpt" in extras, "offload" in extras)
        if "oracle" in extras:
            result.update(oracle(models))
    elif mode == "oracle":
        result.update(oracle(models))
    else:
        resume(trainer, result)
    torch.save(result, os.path.join(OUT, f"{mode}_rank{rank}.pt"))
    trainer.close()
