"""GPU tier (CUDA + Transformer Engine; deselected without CUDA, skipped without TE): the
Transformer Engine layer spec and FP8 through the real megatron-core actor, one process.

- TE spec, bf16: logits match HF transformers within bf16 tolerance and export after import
  reproduces every HF tensor (TE parameter names: fused ``layer_norm_weight``).
- TE spec, FP8 (hybrid, delayed scaling): two ARMOR updates run and give finite metrics.
- TE spec, packed ``thd`` micro-batches: the same log-probs as the padded layout, no padding.
- No reference pass right after a reset: the policy pass's log-probs, equal to a pass through
  the swapped-in pinned copy; an update brings the pass back.
- Reference swaps through one pinned host buffer kept between passes, the live values restored
  bit for bit; ``trainer.concurrent_reference`` off (``auto``) or refused (``true``) with CUDA.
- The tiny Qwen3-MoE on the TE spec (grouped-GEMM experts): logits, export, an update.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_batch, make_models, oracle_tokens  # noqa: E402

pytestmark = pytest.mark.gpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trainer_factory(tmp_path_factory):
    pytest.importorskip("transformer_engine.pytorch")
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    models = make_models(str(tmp_path_factory.mktemp("models")))
    made = []

    def make(fp8: bool) -> MegatronTrainer:
        cfg = ArmorConfig()
        t = cfg.trainer
        t.model_path, t.transformer_impl, t.precision = models["qwen2"], "te", "bf16"
        t.fp8.enabled, t.lr, t.micro_batch_tokens = fp8, 1e-4, 64
        cfg.algo.group_size = 4
        cfg.algo.alpha = 3 / 4  # a hand-built config: alpha as load resolves 'auto' for G = 4
        trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
        made.append(trainer)
        return trainer

    yield models, make
    for trainer in made:
        trainer.close()


def test_te_spec_matches_hf_and_round_trips(trainer_factory) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    models, make = trainer_factory
    trainer = make(fp8=False)
    names = [n for n, _ in trainer.model.named_parameters()]
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    tokens = oracle_tokens().cuda()
    pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
    with torch.no_grad():
        logits = trainer.model(tokens, pos, None)[..., :200].float().cpu()
        hf = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.bfloat16).cuda()
        ref = hf(tokens).logits.float().cpu()
    torch.testing.assert_close(logits, ref, atol=0.1, rtol=0.05)
    source = load_file(os.path.join(models["qwen2"], "model.safetensors"))
    exported = dict(trainer.export_weights())
    assert sorted(exported) == sorted(source)
    for k, v in source.items():
        assert torch.equal(exported[k], v.to(torch.bfloat16)), k
    trainer.close()


def test_fp8_training_step_runs(trainer_factory) -> None:
    _, make = trainer_factory
    trainer = make(fp8=True)
    assert trainer.model.config.fp8 == "hybrid" and trainer.model.config.fp8_recipe == "delayed"
    batch = make_batch()
    lp = trainer.compute_logprobs(batch)
    batch.old_logprobs, batch.ref_logprobs = lp.clone(), lp.clone()
    for _ in range(2):
        metrics = trainer.train_step(batch, 1)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["count/tokens"] == batch.num_response_tokens


def test_packed_thd_matches_the_padded_layout(trainer_factory) -> None:
    """With TE the trainer packs micro-batches (``thd``, megatron-core ``PackedSeqParams``):
    per-token log-probs equal those of the padded ``[n, L]`` layout (bf16 tolerance), no
    position is padding, and an update reports ``train/padding_fraction`` 0."""
    from megatron_armor.trainer.batching import padding_counts, plan_micro_batches
    from megatron_armor.trainer.schedule import logprob_builder, run_schedule

    _, make = trainer_factory
    trainer = make(fp8=False)
    batch = make_batch()
    trainer.model.eval()
    logprobs = {}
    for packed in (False, True):
        mbs = plan_micro_batches(batch, 0, 1, 64, packed=packed)
        with torch.no_grad():
            outputs = run_schedule(trainer.model, mbs, logprob_builder(trainer.lp), True)
        out = torch.zeros(batch.num_tokens)
        for o in outputs:
            out[o["index"]] = o["logp"].float().cpu()
        logprobs[packed] = out * batch.loss_mask.float()
        if packed:
            assert all(mb.packed for mb in mbs)
            assert padding_counts(mbs) == (batch.num_tokens, batch.num_tokens)
    torch.testing.assert_close(logprobs[True], logprobs[False], atol=0.05, rtol=0.05)
    lp = trainer.compute_logprobs(batch)  # the trainer's own path packs
    torch.testing.assert_close(lp, logprobs[True], atol=1e-3, rtol=1e-3)
    batch.old_logprobs, batch.ref_logprobs = lp.clone(), lp.clone()
    assert trainer.train_step(batch, 1)["train/padding_fraction"] == 0.0


def test_no_reference_pass_while_the_reference_is_the_policy_on_gpu(trainer_factory) -> None:
    """Right after a reset ``step_logprobs`` gives the policy pass as the reference log-probs
    (no swap of the pinned copy) and they equal a reference pass through the swapped-in copy;
    the bitwise check of the copies (``equals_live``, used after a checkpoint load) runs on
    the GPU's parameters; an update brings the reference pass back."""
    _, make = trainer_factory
    trainer = make(fp8=False)
    batch = make_batch()
    trainer.reset_reference()
    assert trainer.store.matches_live("ref") and trainer.store.equals_live("ref")
    old, ref, _ = trainer.step_logprobs(batch, True)
    assert torch.equal(ref, old)
    trainer.store.live_changed()  # forget: the next reference pass swaps the copy in
    swapped = trainer.compute_logprobs(batch, "ref")
    torch.testing.assert_close(swapped, old, atol=1e-6, rtol=0)
    trainer.store.mark_live("ref")
    batch.old_logprobs, batch.ref_logprobs = old.clone(), ref.clone()
    trainer.train_step(batch, 1)
    assert not trainer.store.matches_live("ref") and not trainer.store.equals_live("ref")
    old, ref, _ = trainer.step_logprobs(batch, True)
    assert not torch.equal(ref, old)


def test_reference_swaps_reuse_one_pinned_buffer_on_gpu(trainer_factory) -> None:
    """On a CUDA rank the reference pass swaps the pinned copy in (``trainer.concurrent_reference:
    auto`` is off there) through one pinned host buffer kept between swaps, not a fresh
    model-sized pinned allocation per pass; the live values come back bit for bit each time."""
    _, make = trainer_factory
    trainer = make(fp8=False)
    assert trainer.reference is None
    batch = make_batch()
    trainer.store.live_changed()  # the stored copy equals the live weights: force the swaps
    live = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    first = trainer.compute_logprobs(batch, "ref")
    buffers = {k: b.data_ptr() for k, b in trainer.store._backup.items()}
    assert buffers and all(b.is_pinned() for b in trainer.store._backup.values())
    second = trainer.compute_logprobs(batch, "ref")
    assert {k: b.data_ptr() for k, b in trainer.store._backup.items()} == buffers
    assert torch.equal(first, second)
    for k, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), live[k]), k


def test_concurrent_reference_true_is_refused_on_a_cuda_rank() -> None:
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.reference_model import concurrent_reference

    cfg = ArmorConfig()
    assert concurrent_reference(cfg, None, None) is None  # auto: off with CUDA
    cfg.trainer.concurrent_reference = True
    with pytest.raises(ValueError, match="concurrent_reference=true on a rank with CUDA"):
        concurrent_reference(cfg, None, None)


def test_moe_te_grouped_gemm_matches_hf_and_trains(tmp_path) -> None:
    """The tiny Qwen3-MoE with the TE spec: experts in grouped GEMMs (``TEGroupedMLP``,
    parameters ``linear_fc1.weight{j}``), logits within bf16 tolerance of transformers', the
    export after import every HF tensor, and an update with the load-balancing loss logging it."""
    pytest.importorskip("transformer_engine.pytorch")
    from safetensors.torch import load_file
    from tiny_models import make_moe_model
    from transformers import AutoModelForCausalLM

    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    model_dir = make_moe_model(str(tmp_path))
    cfg = ArmorConfig()
    t = cfg.trainer
    t.model_path, t.transformer_impl, t.precision = model_dir, "te", "bf16"
    t.lr, t.micro_batch_tokens, t.moe.aux_loss_coeff = 1e-4, 64, 1e-2
    cfg.algo.group_size, cfg.algo.alpha = 4, 3 / 4
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
    names = [n for n, _ in trainer.model.named_parameters()]
    assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in names)
    tokens = oracle_tokens().cuda()
    pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
    with torch.no_grad():
        logits = trainer.model(tokens, pos, None)[..., :200].float().cpu()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
        ref = hf(tokens).logits.float().cpu()
    torch.testing.assert_close(logits, ref, atol=0.1, rtol=0.05)
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    exported = dict(trainer.export_weights())
    assert sorted(exported) == sorted(source)
    for k, v in source.items():
        assert torch.equal(exported[k], v.to(torch.bfloat16)), k
    batch = make_batch()
    lp = trainer.compute_logprobs(batch)
    batch.old_logprobs, batch.ref_logprobs = lp.clone(), lp.clone()
    metrics = trainer.train_step(batch, 1)
    assert metrics["train/moe_aux_loss"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    trainer.close()


def test_moe_replay_under_recompute_equals_the_update_without(tmp_path) -> None:
    """``r2`` with ``trainer.recompute``: the recomputation in the backward replays the routes
    its micro-batch's forward used (``REPLAY_BACKWARD``, oldest first over several packed
    micro-batches of different shapes), so the update equals the one without recompute."""
    pytest.importorskip("transformer_engine.pytorch")
    from tiny_models import make_moe_model

    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    model_dir = make_moe_model(str(tmp_path))
    results = []
    for recompute in (False, True):
        cfg = ArmorConfig()
        t = cfg.trainer
        t.model_path, t.transformer_impl, t.precision = model_dir, "te", "fp32"
        t.lr, t.micro_batch_tokens, t.recompute = 1e-3, 24, recompute
        t.moe.routing_replay = "r2"
        cfg.algo.group_size, cfg.algo.alpha = 4, 3 / 4
        trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
        batch = make_batch()
        old, ref, _ = trainer.step_logprobs(batch, with_ref=True, shared=True)
        held = trainer.recorded_routes.held  # one rank: every sample's routes, a byte each
        assert held.rows.dtype == torch.uint8 and held.rows.shape[0] == batch.num_tokens
        batch.old_logprobs, batch.ref_logprobs = old, ref
        results.append(trainer.train_step(batch, 2))
        trainer.close()
    plain, recomputed = results
    for key in ("loss/pg", "loss/grad_norm", "loss/ratio_mean", "moe/route_agree_update"):
        assert recomputed[key] == pytest.approx(plain[key], abs=1e-5, rel=1e-5), key
