"""One trainer rank of the mixture-of-experts dist tests (run as a script, one per rank).

``python moe_worker.py MODE RANK WORLD PORT OUT MODEL_DIR TP EP ETP``

- ``run``: a ``MegatronTrainer`` on the tiny Qwen3-MoE with ``trainer.tp / ep / etp = TP / EP /
  ETP`` (the rest of the world is data parallel; sequence parallelism with ``TP > 1``), built
  with a load-balancing loss: logits on fixed tokens, the
  exported HF tensors right after the import, policy log-probs, two ARMOR updates with the
  loss's coefficient at 0 (the Switch loss is taken per micro-batch, so with it on the
  gradients depend on how the ranks split the batch) and a checkpoint after the first, the
  exported weights after each; then, loss off, on a batch the two DP ranks of EP=2 split
  into 2 and 1 micro-batches (:data:`UNEVEN`): the policy log-probs, the exact-KL
  diagnostic's passes over some of its samples, one update and its weights; then a third
  update with the loss on.
  Then routing replay against the embedded engine (:func:`replay`): the routers are set to
  near-ties, the engine takes the trainer's weights and draws samples with their routes, and
  the ``old`` pass runs with ``trainer.moe.routing_replay`` ``off`` and ``r3``.
- ``pp_replay``: the routing-replay part alone with two pipeline stages (``EP`` = 1; a
  4-layer model: each stage replays its own layers' routes).
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
TIE_EPS = 1e-6
"""Spread of the near-tied router rows (:func:`near_tie_routers`)."""
UNEVEN = (0, 1, 2, 3, 4, 5)
"""Samples of ``make_batch`` (lengths 5, 8, 11, 14, 7, 10) that two DP ranks split into
2 micro-batches ({0, 1}, {3}) and 1 ({4, 5, 2}) at ``micro_batch_tokens = 40``."""
UNEVEN_KL = (1, 3)
"""Samples of the uneven batch whose tokens the exact-KL diagnostic takes: both on DP rank 0."""


def near_tie_routers(trainer) -> None:
    """Every router's rows set to one row plus ``TIE_EPS`` noise (the same on every rank): the
    experts' scores of a token differ by about the rounding of the router's input, so two
    implementations (transformers' and megatron-core's layers) route some token-layers
    differently, as engines and trainers do at scale. The reference copy follows."""
    from megatron_armor.trainer.hf_weights import unwrap

    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in unwrap(trainer.model).named_parameters():
            if name.endswith("mlp.router.weight"):
                noise = TIE_EPS * torch.randn(param.shape, generator=gen)
                param.copy_(param[:1].expand_as(param) + noise.to(param.dtype))
    trainer.store.live_changed()
    trainer.reset_reference()


def engine_batch(trainer, engine):
    """Two groups of four samples (the last an anchor) drawn by the embedded engine with the
    trainer's weights, with their routes and log-probs."""
    from megatron_armor.rollout.protocol import SamplingParams
    from megatron_armor.types import Group, Sample, SampleSource, pack_groups

    stage = dict(trainer.export_weights(every_rank=True))  # this pipeline stage's tensors
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, stage)
    engine.update_weights([kv for part in stages for kv in part.items()], 1)
    params = SamplingParams(temperature=0.9, max_new_tokens=10, seed=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    groups = []
    for g, outs in enumerate(engine.generate(prompts, 4, params)):
        samples = [
            Sample(f"q{g}", prompts[g], o.token_ids, o.logprobs, routed_experts=o.routed_experts,
                   source=SampleSource.REFERENCE if i == 3 else SampleSource.POLICY)
            for i, o in enumerate(outs)
        ]  # fmt: skip
        groups.append(Group(f"q{g}", samples, anchor_index=3, advantages=[1.0, -0.5, -1.5, 1.0]))
    return pack_groups(groups)


def replay(trainer, out: dict, engine) -> None:
    """The ``old`` pass on engine samples with routing replay ``off`` and ``r3``."""
    near_tie_routers(trainer)
    batch = engine_batch(trainer, engine)
    out["engine_lp"], out["loss_mask"] = batch.engine_logprobs, batch.loss_mask
    for mode in ("off", "r3"):
        trainer.config.trainer.moe.routing_replay = mode
        old, ref, metrics = trainer.step_logprobs(batch, with_ref=True, shared=True)
        out[f"replay_{mode}"] = {"old": old, "metrics": metrics}
    update_routes(trainer, out, batch)
    batch.old_logprobs, batch.ref_logprobs = old, ref
    out["replay_update"] = trainer.train_step(batch, 2)


def update_routes(trainer, out: dict, batch) -> None:
    """The routes an update of the ``r3`` batch gets (samples in reverse order: other
    data-parallel shards than the ``old`` pass's), fetched from the ranks that recorded them:
    on policy samples they are the engine's (the ``old`` pass replayed those)."""
    from megatron_armor.trainer import parallel
    from megatron_armor.trainer.routing_replay import sample_kinds
    from megatron_armor.trainer.routing_replay import update_routes as fetch
    from megatron_armor.types import ROUTES_KEY, route_ids

    mini = batch.select(list(range(batch.num_samples))[::-1])
    held = fetch(trainer.recorded_routes, mini, parallel.dp_rank(), parallel.dp_size(),
                 parallel.dp_group())  # fmt: skip
    bounds = mini.cu_seqlens.tolist()
    pos = torch.tensor([p for i in held.samples for p in range(bounds[i], bounds[i + 1])])
    engine = route_ids(mini.token_data[ROUTES_KEY])[pos][:, held.layers].long()
    policy = (sample_kinds(mini)[pos] == 1) & (engine[:, 0, 0] >= 0)
    out["update_routes"] = {
        "own_tokens": sum(held.lengths),
        "shard_tokens": sum(mini.seq_lengths()[i] for i in held.samples),
        "layers": held.layers, "dtype": held.rows.dtype, "policy_rows": int(policy.sum()),
        "equal": bool((held.rows.long()[policy] == engine[policy]).all()),
    }  # fmt: skip


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


def forward(trainer, out: dict, out_dir: str, engine=None) -> None:
    out["logits"] = logits(trainer)
    out["export0"] = dict(trainer.export_weights())
    out["lp0"] = full(trainer.compute_logprobs(make_batch(), "policy"))


def run(trainer, out: dict, out_dir: str, engine) -> None:
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
    uneven_split(trainer, out)
    trainer.config.trainer.moe.aux_loss_coeff = AUX_LOSS_COEFF
    out["m3"] = trainer.train_step(batch, 1)
    if engine is not None:
        replay(trainer, out, engine)


def uneven_split(trainer, out: dict) -> None:
    """Log-probs, the exact-KL diagnostic and an update on :data:`UNEVEN` (DP ranks with
    unequal micro-batch counts: the trainer pads them with fillers when EP spans DP)."""
    batch = make_batch().select(list(UNEVEN))
    lp = full(trainer.compute_logprobs(batch, "policy"))
    bounds = batch.cu_seqlens.tolist()
    kl_mask = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for i in UNEVEN_KL:
        kl_mask[bounds[i] : bounds[i + 1]] = True
    old, _, out["kl_u"] = trainer.step_logprobs(batch, False, kl_mask & batch.loss_mask.bool())
    out["lp_u"], out["old_u"] = lp, full(old)
    batch.old_logprobs = perturb(lp, batch.loss_mask, 3, 0.3)
    batch.ref_logprobs = perturb(lp, batch.loss_mask, 4, 0.3)
    out["m_u"] = trainer.train_step(batch, 1)
    out["w_u"] = dict(trainer.export_weights())


def pp_replay(trainer, out: dict, out_dir: str, engine) -> None:
    replay(trainer, out, engine)


def resume(trainer, out: dict, out_dir: str, engine=None) -> None:
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
    from megatron_armor.rollout.torch_engine import TorchEngine
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    # the engine before the trainer: the trainer's CPU mode stands in for torch.cuda names
    # transformers reads when it loads a model; routing replay runs at ETP = 1 only
    replays = mode == "pp_replay" or (mode == "run" and etp == 1)
    engine = TorchEngine(model_dir, return_routed_experts=True) if replays else None
    config = moe_config(model_dir, world, tp, ep, etp)
    config.trainer.pp = 2 if mode == "pp_replay" else 1
    trainer = MegatronTrainer(config, rank, world, "127.0.0.1", int(port))
    result: dict = {"ep_rank": dist.get_rank()}
    modes = {"run": run, "resume": resume, "forward": forward, "pp_replay": pp_replay}
    modes[mode](trainer, result, out_dir, engine)
    torch.save(result, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    trainer.close()
