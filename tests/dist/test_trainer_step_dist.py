"""Dist tier: a step's trainer work as the loop now does it, against the plain way.

One megatron-core trainer rank (gloo, CPU, padded layout) in a subprocess, bounded:

- Bucketing micro-batches by length leaves one update's loss and gradients as they were (the
  normalizer is global; per-sample terms stay within a micro-batch): the same ARMOR
  mini-batch goes through the forward-backward schedule as batch-order micro-batches and as
  length-bucketed ones, for ``token-mean`` and ``seq-mean-token-mean``; the loss and every
  parameter's gradient agree to float tolerance while the bucketed micro-batches pad less.
- ``step_logprobs`` (one call: old + reference log-probs + the exact-KL diagnostic reusing
  the policy pass) equals ``compute_logprobs`` twice and ``exact_kl`` on the diagnostic's
  own batch, after an update moved the policy away from the reference; with ``with_ref``
  off it returns no reference log-probs but the same diagnostic, its reference pass over the
  diagnostic's samples only.
- Right after a reset the reference pass is not run (no weight swap) and its results are what
  it would give, bit for bit: reference log-probs equal to the policy's and to a reference
  pass's, exact KLs of zero with the diagnostic's positions. An update brings the pass back; a
  checkpoint saved right after a reset skips it again once loaded, one saved after an update
  does not.
- A one-step-off batch's ``old`` pass under the behavior weights kept before an update
  (``orchestration.async_rollout``) equals the pass before the update bit for bit, leaves the
  live weights as they were, and survives a checkpoint.

Run as a script (``python this_file.py MODEL_DIR OUT PORT``) it is the trainer rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import make_batch, make_models, perturb  # noqa: E402

from megatron_armor.trainer.ranks import run_rank_processes  # noqa: E402

pytestmark = pytest.mark.dist

LOSS_TOL = 1e-5  # relative: the same sums in another order
BUDGET = 40  # tokens per micro-batch: make_batch()'s 8 samples (5-16 tokens) need several
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def one_update(trainer, batch, bucket: bool, loss_agg: str) -> dict:
    """Loss and gradients of one forward-backward pass over ``batch`` (no optimizer step)."""
    from megatron_armor.trainer.batching import padding_counts, plan_micro_batches
    from megatron_armor.trainer.schedule import global_units, policy_loss_builder, run_schedule

    mbs = plan_micro_batches(batch, 0, 1, BUDGET, bucket=bucket)
    settings = dataclasses.replace(trainer.loss_settings, loss_agg=loss_agg)
    builder = policy_loss_builder(trainer.lp, settings, global_units(mbs, loss_agg))
    trainer.model.train()
    trainer.model.zero_grad_buffer()
    outputs = run_schedule(trainer.model, mbs, builder, forward_only=False)
    return {
        "loss": sum(float(o["loss/objective"]) for o in outputs),
        "grads": {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()},
        "order": [mb.token_index.tolist() for mb in mbs],
        "padding": padding_counts(mbs),
    }


def step_logprobs_vs_plain(trainer, batch) -> dict:
    from megatron_armor.orchestration.step.step_metrics import exact_kl_batch, exact_kl_mask

    mask = exact_kl_mask(batch, 3, 4)
    mbs = trainer._micro_batches(batch)
    return {
        "positions": int(mask.sum()),
        "samples": (
            sum(len(mb.samples) for mb in mbs),
            sum(len(mb.samples) for _, mb in trainer._diagnostic_micro_batches(batch, mbs, mask)),
        ),
        "one_call": trainer.step_logprobs(batch, True, mask),
        "no_ref": trainer.step_logprobs(batch, False, mask),
        "plain": (
            trainer.compute_logprobs(batch, "policy"),
            trainer.compute_logprobs(batch, "ref"),
            trainer.exact_kl(exact_kl_batch(batch, 3, 4)),
        ),
    }


def reference_after_reset(trainer, batch, ckpt_dir: str) -> dict:
    """``step_logprobs`` and the weight swaps it made: after a reset, after an update, and
    after loading checkpoints saved at each point; with the plain passes to compare."""
    from megatron_armor.orchestration.step.step_metrics import exact_kl_batch, exact_kl_mask

    swaps: list[str] = []
    swapped = trainer.store.swapped

    def counting(name):
        swaps.append(name)
        return swapped(name)

    trainer.store.swapped = counting
    if trainer.reference is not None:  # the reference pass beside the policy pass: no swap
        submit = trainer.reference.submit

        def counting_submit(copy, micro_batches, builder, routing=None):
            swaps.append("ref")
            return submit(copy, micro_batches, builder, routing)

        trainer.reference.submit = counting_submit
    mask = exact_kl_mask(batch, 3, 4)

    def one_call():
        swaps.clear()
        result = trainer.step_logprobs(batch, True, mask)
        return result, list(swaps)

    out = {}
    trainer.reset_reference()
    trainer.save_checkpoint(os.path.join(ckpt_dir, "reset"), {"at": "reset"})
    out["reset"] = one_call()
    out["reset_plain"] = (
        trainer.compute_logprobs(batch, "ref"),
        trainer.exact_kl(exact_kl_batch(batch, 3, 4)),
    )
    trainer.train_step(batch, 1)
    trainer.save_checkpoint(os.path.join(ckpt_dir, "updated"), {"at": "updated"})
    out["updated"] = one_call()
    out["updated_plain"] = trainer.compute_logprobs(batch, "ref")  # the reset's copy, swapped in
    trainer.load_checkpoint(os.path.join(ckpt_dir, "reset"))
    out["loaded_reset"] = one_call()
    trainer.load_checkpoint(os.path.join(ckpt_dir, "updated"))
    out["loaded_updated"] = one_call()
    return out


def behavior_pass(trainer, batch, ckpt_dir: str) -> dict:
    """A one-step-off batch's ``old`` pass (``orchestration.async_rollout``): under the weights
    kept before the updates, against the live pass at that point; after a checkpoint round
    trip too (the live weights moved on in between)."""
    out = {"before": trainer.step_logprobs(batch, True, None)}
    trainer.snapshot_behavior()
    trainer.train_step(batch, 1)
    out["live_after"] = trainer.compute_logprobs(batch)
    out["behavior"] = trainer.step_logprobs(batch, True, None, old_weights="behavior")
    out["live_after_pass"] = trainer.compute_logprobs(batch)  # the swap restored the live ones
    trainer.save_checkpoint(os.path.join(ckpt_dir, "behavior"), {"at": "behavior"})
    trainer.train_step(batch, 1)
    trainer.store.copies.pop("behavior")  # as in a new process
    trainer.load_checkpoint(os.path.join(ckpt_dir, "behavior"))
    out["loaded"] = trainer.step_logprobs(batch, True, None, old_weights="behavior")
    out["loaded_live"] = trainer.compute_logprobs(batch)
    return out


def trainer_main(model_dir: str, out: str, port: int) -> None:
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    cfg = ArmorConfig()
    cfg.trainer.model_path, cfg.trainer.precision = model_dir, "fp32"
    cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-3, 0  # one update moves the policy visibly
    cfg.algo.ratio, cfg.algo.group_size = "mixed", 4  # alpha 'auto': 3/4
    cfg.rollout.sampling.temperature = 0.9
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", port)
    try:
        batch = make_batch()
        logprobs = trainer.compute_logprobs(batch)
        batch.old_logprobs = perturb(logprobs, batch.loss_mask, 1, 0.3)
        batch.ref_logprobs = perturb(logprobs, batch.loss_mask, 2, 0.3)
        results = {
            (agg, bucket): one_update(trainer, batch, bucket, agg)
            for agg in AGGREGATIONS
            for bucket in (False, True)
        }
        trainer.train_step(batch, 1)  # the policy moves away from the reference
        concurrent = trainer.reference  # trainer.concurrent_reference=auto: one CPU rank
        results["concurrent"] = concurrent is not None
        results["step"] = step_logprobs_vs_plain(trainer, batch)
        trainer.reference = None  # the passes one after the other, under the swapped copy
        results["step_sequential"] = step_logprobs_vs_plain(trainer, batch)
        trainer.reference = concurrent
        results["reset"] = reference_after_reset(trainer, batch, os.path.dirname(out))
        results["behavior"] = behavior_pass(trainer, batch, os.path.dirname(out))
        torch.save(results, out)
    finally:
        trainer.close()


@pytest.mark.timeout(300)
def test_trainer_step_work(tmp_path) -> None:
    import socket

    model_dir = make_models(str(tmp_path / "models"))["qwen2"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "out.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, __file__, model_dir, out, str(port)]
    run_rank_processes([command], [str(tmp_path / "log.txt")], env, 280)
    results = torch.load(out, weights_only=False)
    for agg in AGGREGATIONS:
        plain, bucketed = results[(agg, False)], results[(agg, True)]
        assert plain["order"] != bucketed["order"]  # the micro-batches really differ
        assert bucketed["padding"][1] < plain["padding"][1]  # and pad less
        assert bucketed["padding"][0] == plain["padding"][0]
        assert abs(bucketed["loss"] - plain["loss"]) <= LOSS_TOL * max(1.0, abs(plain["loss"]))
        assert any(g.abs().sum() > 0 for g in plain["grads"].values())
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(bucketed["grads"][name], grad, atol=1e-6, rtol=1e-5)
    old, ref, kl = results["step"]["plain"]
    assert kl["kl/exact_reverse"] > 0 and kl["kl/exact_positions"] == results["step"]["positions"]
    one_old, one_ref, one_kl = results["step"]["one_call"]
    torch.testing.assert_close(one_old, old, atol=1e-5, rtol=0)
    torch.testing.assert_close(one_ref, ref, atol=1e-5, rtol=0)
    assert results["step"]["samples"] == (8, 3)  # the diagnostic's reference pass: 3 samples
    no_old, no_ref, no_kl = results["step"]["no_ref"]
    assert no_ref is None
    torch.testing.assert_close(no_old, old, atol=1e-5, rtol=0)
    for got in (one_kl, no_kl):
        assert sorted(got) == sorted(kl)
        for key, value in kl.items():
            assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), key
    assert results["concurrent"]
    sequential = results["step_sequential"]
    for key in ("one_call", "no_ref"):  # the concurrent reference pass's values
        for got, want in zip(results["step"][key], sequential[key], strict=True):
            assert_same_pass(got, want, key)
    check_reference_after_reset(results["reset"], results["step"]["positions"])
    check_behavior_pass(results["behavior"])


def check_behavior_pass(got: dict) -> None:
    """The kept weights give the pre-update pass bit for bit (the same computation on the same
    values), the live weights are untouched by it, and a checkpoint keeps the copy."""
    old, ref, _ = got["before"]
    old_b, ref_b, _ = got["behavior"]
    assert torch.equal(old_b, old) and torch.equal(ref_b, ref)
    assert not torch.equal(got["live_after"], old)  # the update moved the live weights
    assert torch.equal(got["live_after_pass"], got["live_after"])
    old_l, ref_l, _ = got["loaded"]
    assert torch.equal(old_l, old) and torch.equal(ref_l, ref)
    assert torch.equal(got["loaded_live"], got["live_after"])  # the checkpoint's live weights


def assert_same_pass(got, want, key: str) -> None:
    """The concurrent reference pass against the sequential one: the same kernels on the same
    values, but from the stored copy's memory (a second model aliasing it) instead of the live
    parameters it is copied into: within fp32 rounding, since a CPU's kernels may round data
    laid out differently in the last digits (bit-identical on the Intel Xeon and AMD EPYC
    measured)."""
    if got is None or want is None:
        assert got is None and want is None, key
    elif isinstance(got, torch.Tensor):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    else:
        assert sorted(got) == sorted(want), key
        for name, value in want.items():
            assert abs(got[name] - value) <= 1e-6 * max(1.0, abs(value)), (key, name)


def check_reference_after_reset(got: dict, positions: int) -> None:
    (old, ref, kl), swaps = got["reset"]
    plain_ref, plain_kl = got["reset_plain"]
    assert swaps == []  # no reference pass
    assert torch.equal(ref, old) and torch.equal(ref, plain_ref) and ref is not old
    assert kl == plain_kl  # what the two passes give, exactly
    assert kl["kl/exact_positions"] == positions
    assert all(v == 0.0 for k, v in kl.items() if k != "kl/exact_positions")
    (old_u, ref_u, kl_u), swaps = got["updated"]
    assert swaps == ["ref"] and not torch.equal(ref_u, old_u) and kl_u["kl/exact_reverse"] > 0
    assert torch.equal(ref_u, got["updated_plain"])  # the copy the reset stored, not an older one
    (old_l, ref_l, kl_l), swaps = got["loaded_reset"]
    assert swaps == [] and torch.equal(old_l, old) and torch.equal(ref_l, ref) and kl_l == kl
    (old_l, ref_l, kl_l), swaps = got["loaded_updated"]
    assert swaps == ["ref"] and torch.equal(old_l, old_u) and torch.equal(ref_l, ref_u)
    assert kl_l == kl_u


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    trainer_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
