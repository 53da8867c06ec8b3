"""The real megatron-core actor in one process, written once for the ``device`` fixture (gpu
tier with CUDA and Transformer Engine: the TE layer spec, bf16, FP8; dist tier on CPU: the
local spec, fp32, gloo, with the lines that need TE or CUDA left out, each naming why).

- The trainer's logits match HF transformers and its export after import reproduces every HF
  tensor (TE: fused ``layer_norm_weight`` names, bf16 tolerance).
- Two ARMOR updates give finite metrics (FP8 on a GPU: hybrid, delayed scaling).
- The trainer's own log-prob path equals the padded layout's; with TE it packs (``thd``): no
  padding, ``train/padding_fraction`` 0.
- No reference pass right after a reset: the policy pass's log-probs, equal to a pass through
  the swapped-in copy; an update brings the pass back.
- Reference swaps through one host buffer kept between passes (pinned with CUDA), the live
  values restored bit for bit.
- The tiny Qwen3-MoE: logits, export, an update logging the load-balancing loss (TE: grouped
  GEMM experts); ``r2`` replay under recompute equals the update without.

Every test takes its trainer from ``make``, which closes the one before (megatron-core keeps
one set of process groups per process) and the last at the module's end. The module runs in a
process of its own (``own_process``, tests/conftest.py): on CPU a trainer switches its process
to megatron-core's CPU mode.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from megatron_armor.net import free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_batch, make_models, make_moe_model, oracle_tokens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.own_process]
TOL = {"cuda": {"atol": 0.1, "rtol": 0.05}, "cpu": {"atol": 1e-4, "rtol": 0}}
"""Logits against transformers': bf16 kernels on a GPU, fp32 on CPU."""
TE_ON_GPU = "the Transformer Engine spec needs CUDA"


@pytest.fixture(scope="module")
def models(tmp_path_factory, device):
    if device.type == "cuda":
        pytest.importorskip("transformer_engine.pytorch")
    root = str(tmp_path_factory.mktemp("models"))
    return {**make_models(root), "moe": make_moe_model(root)}


@pytest.fixture(scope="module")
def make(models, device):
    """``make(model, **trainer settings)``: a one-rank trainer (TE bf16 on a GPU, local fp32 on
    CPU), the previous one closed first."""
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    made: list = []

    def build(model: str = "qwen2", fp8: bool = False, **settings) -> MegatronTrainer:
        """``settings``: ``trainer`` fields, nested ones by ``__`` (``moe__routing_replay``)."""
        close(made)
        cfg = ArmorConfig()
        t = cfg.trainer
        t.model_path, t.fp8.enabled, t.lr, t.micro_batch_tokens = models[model], fp8, 1e-4, 64
        gpu = device.type == "cuda"
        t.transformer_impl, t.precision = ("te", "bf16") if gpu else ("local", "fp32")
        t.concurrent_reference = False  # the reference pass swaps copies in, as on a GPU
        t.warmup_steps = 0  # the first update moves the weights (a warm-up starts at lr 0)
        for key, value in settings.items():
            *parents, field = key.split("__")
            owner = t
            for parent in parents:
                owner = getattr(owner, parent)
            setattr(owner, field, value)
        cfg.algo.group_size = 4
        cfg.algo.alpha = 3 / 4  # a hand-built config: alpha as load resolves 'auto' for G = 4
        made.append(MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port()))
        return made[-1]

    yield build
    close(made)


def close(made: list) -> None:
    while made:
        made.pop().close()


def dtype_of(trainer) -> torch.dtype:
    return torch.bfloat16 if trainer.config.trainer.precision == "bf16" else torch.float32


def assert_matches_hf_and_round_trips(trainer, model_dir: str, device) -> None:
    """Logits within tolerance of transformers' on the same weights; the export equals every
    tensor of the HF checkpoint (in the trainer's dtype)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dtype = dtype_of(trainer)
    tokens = oracle_tokens().to(device)
    pos = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    with torch.no_grad():
        logits = trainer.model(tokens, pos, None)[..., :200].float().cpu()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        ref = hf(tokens).logits.float().cpu()
    torch.testing.assert_close(logits, ref, **TOL[device.type])
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    exported = dict(trainer.export_weights())
    assert sorted(exported) == sorted(source)
    for k, v in source.items():
        assert torch.equal(exported[k], v.to(dtype)), k


def test_the_trainer_matches_hf_and_round_trips(make, models, device, cuda_only) -> None:
    trainer = make()
    names = [n for n, _ in trainer.model.named_parameters()]
    if cuda_only(TE_ON_GPU):
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    assert_matches_hf_and_round_trips(trainer, models["qwen2"], device)


def test_two_updates_give_finite_metrics_fp8_on_a_gpu(make, device, cuda_only) -> None:
    fp8 = cuda_only("FP8 GEMMs need Transformer Engine on CUDA")
    trainer = make(fp8=fp8)
    if fp8:
        assert trainer.model.config.fp8 == "hybrid" and trainer.model.config.fp8_recipe == "delayed"
    batch = make_batch()
    lp = trainer.compute_logprobs(batch)
    batch.old_logprobs, batch.ref_logprobs = lp.clone(), lp.clone()
    for _ in range(2):
        metrics = trainer.train_step(batch, 1)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["count/tokens"] == batch.num_response_tokens


def test_the_trainers_logprobs_equal_the_padded_layout(make, cuda_only) -> None:
    """Per-token log-probs of the trainer's own path equal those of the padded ``[n, L]``
    schedule. With TE the trainer packs micro-batches (``thd``, megatron-core
    ``PackedSeqParams``): no position is padding, the two layouts agree within bf16
    tolerance, and an update reports ``train/padding_fraction`` 0."""
    from megatron_armor.trainer.batching import padding_counts, plan_micro_batches
    from megatron_armor.trainer.schedule import logprob_builder, run_schedule

    trainer = make()
    batch = make_batch()
    trainer.model.eval()
    layouts = (
        [False, True] if cuda_only("packed thd micro-batches need TE's attention") else [False]
    )
    logprobs = {}
    for packed in layouts:
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
    if True in logprobs:
        torch.testing.assert_close(logprobs[True], logprobs[False], atol=0.05, rtol=0.05)
    lp = trainer.compute_logprobs(batch)  # the trainer's own path (packed with TE)
    torch.testing.assert_close(lp, logprobs[max(logprobs)], atol=1e-3, rtol=1e-3)
    batch.old_logprobs, batch.ref_logprobs = lp.clone(), lp.clone()
    metrics = trainer.train_step(batch, 1)
    if True in logprobs:
        assert metrics["train/padding_fraction"] == 0.0


def test_no_reference_pass_while_the_reference_is_the_policy(make) -> None:
    """Right after a reset ``step_logprobs`` gives the policy pass as the reference log-probs
    (no swap of the stored copy) and they equal a reference pass through the swapped-in copy;
    the bitwise check of the copies (``equals_live``, used after a checkpoint load) runs on
    the device's parameters; an update brings the reference pass back."""
    trainer = make()
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


def test_reference_swaps_reuse_one_host_buffer(make, cuda_only) -> None:
    """The reference pass swaps the stored copy in through one host buffer kept between
    swaps (pinned with CUDA), not a fresh model-sized allocation per pass; the live values
    come back bit for bit each time. With CUDA ``trainer.concurrent_reference: auto`` is off,
    so a rank always swaps (``make`` turns it off on CPU too)."""
    trainer = make()
    assert trainer.reference is None
    batch = make_batch()
    trainer.store.live_changed()  # the stored copy equals the live weights: force the swaps
    live = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    first = trainer.compute_logprobs(batch, "ref")
    buffers = {k: b.data_ptr() for k, b in trainer.store._backup.items()}
    assert buffers
    if cuda_only("pinned host memory needs CUDA"):
        assert all(b.is_pinned() for b in trainer.store._backup.values())
    second = trainer.compute_logprobs(batch, "ref")
    assert {k: b.data_ptr() for k, b in trainer.store._backup.items()} == buffers
    assert torch.equal(first, second)
    for k, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), live[k]), k


def test_moe_matches_hf_and_trains(make, models, device, cuda_only) -> None:
    """The tiny Qwen3-MoE: logits within tolerance of transformers', the export after import
    every HF tensor, and an update with the load-balancing loss logging it; with TE the
    experts are grouped GEMMs (``TEGroupedMLP``, parameters ``linear_fc1.weight{j}``)."""
    trainer = make("moe", moe__aux_loss_coeff=1e-2)
    names = [n for n, _ in trainer.model.named_parameters()]
    if cuda_only("grouped-GEMM experts are Transformer Engine's"):
        assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in names)
    assert_matches_hf_and_round_trips(trainer, models["moe"], device)
    batch = make_batch()
    lp = trainer.compute_logprobs(batch)
    batch.old_logprobs, batch.ref_logprobs = lp.clone(), lp.clone()
    metrics = trainer.train_step(batch, 1)
    assert metrics["train/moe_aux_loss"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_moe_replay_under_recompute_equals_the_update_without(make, cuda_only) -> None:
    """``r2`` with ``trainer.recompute``: the recomputation in the backward replays the routes
    its micro-batch's forward used (``REPLAY_BACKWARD``, oldest first over several packed
    micro-batches of different shapes), so the update equals the one without recompute."""
    runs = [False]
    if cuda_only("megatron-core's activation recompute keeps the CUDA RNG state"):
        runs.append(True)
    results = []
    for recompute in runs:
        trainer = make("moe", precision="fp32", lr=1e-3, micro_batch_tokens=24,
                       recompute=recompute, moe__routing_replay="r2")  # fmt: skip
        batch = make_batch()
        old, ref, _ = trainer.step_logprobs(batch, with_ref=True, shared=True)
        held = trainer.recorded_routes.held  # one rank: every sample's routes, a byte each
        assert held.rows.dtype == torch.uint8 and held.rows.shape[0] == batch.num_tokens
        batch.old_logprobs, batch.ref_logprobs = old, ref
        results.append(trainer.train_step(batch, 2))
        assert all(torch.isfinite(torch.tensor(v)) for v in results[-1].values())
    for recomputed in results[1:]:
        for key in ("loss/pg", "loss/grad_norm", "loss/ratio_mean", "moe/route_agree_update"):
            assert recomputed[key] == pytest.approx(results[0][key], abs=1e-5, rel=1e-5), key
