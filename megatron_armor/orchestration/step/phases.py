"""The phases of a step that the synchronous loop (``loop.py``) and the one-step-off
pipeline (``async_rollout.py``) share, as verbs on the session's actor handles: the trainer's
log-prob call and updates (queued, then waited for), the weight sync and the reference reset,
validation, and when validation and checkpoints are due.
"""

from __future__ import annotations

import torch

from megatron_armor.algo.advantages import assign_configured_advantages
from megatron_armor.algo.losses import needs_reference_logprobs
from megatron_armor.algo.registry import get_rollout_correction
from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.validate import (
    groups_per_update,
)
from megatron_armor.observability.nvtx import nvtx_range
from megatron_armor.orchestration.actors.actor_handles import RemoteScorer
from megatron_armor.orchestration.actors.pending import Pending
from megatron_armor.orchestration.actors.rollout_draws import RemoteEngine
from megatron_armor.orchestration.run.session import Session
from megatron_armor.orchestration.step.anchor_rollout import derive_seed
from megatron_armor.orchestration.step.step_metrics import (
    exact_kl_mask,
    logprob_mismatch_metrics,
    reduce_update_metrics,
)
from megatron_armor.orchestration.step.update_guard import skip_metrics
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.types import Group, TrainBatch, pack_groups

NO_UPDATE = {"train/updates": 0.0, "train/response_tokens": 0.0, "train/prompt_tokens": 0.0}
"""The trainer's counts of a step that accepted no query (no update)."""


def minibatch_sample_ids(
    groups: list[Group], num_minibatches: int, min_groups: int = 1
) -> list[list[int]]:
    """Sample indices of each mini-batch: consecutive groups, ``len(groups) / num_minibatches``
    each (``rollout.batch / ppo_mini_batch``). A short batch (``acceptance.py``) keeps the
    number of updates: the first ``len(groups) % num_minibatches`` mini-batches get one group
    more; with fewer than ``num_minibatches * min_groups`` groups (``min_groups``:
    ``config.validate.groups_per_update``, a sequence for every data-parallel rank) mini-batch
    ``m`` takes the ``min_groups`` groups from ``m * min_groups`` on, cyclically: the groups in
    turn, each trained more than once (as PPO's epochs over one batch)."""
    starts = [sum(len(g.samples) for g in groups[:i]) for i in range(len(groups))]
    ids = lambda i: list(range(starts[i], starts[i] + len(groups[i].samples)))  # noqa: E731
    if len(groups) < num_minibatches * min_groups:
        return [[s for j in range(min_groups) for s in ids((m * min_groups + j) % len(groups))]
                for m in range(num_minibatches)]  # fmt: skip
    per, extra = divmod(len(groups), num_minibatches)
    out, first = [], 0
    for m in range(num_minibatches):
        last = first + per + (m < extra)
        out.append([s for i in range(first, last) for s in ids(i)])
        first = last
    return out


def require_engine_logprobs(config: ArmorConfig, batch: TrainBatch, step: int) -> None:
    """A rollout correction weights each token by the engine's log-prob of it: refuse a batch
    in which a sample came without them (``engine_logprobs`` NaN, ``types.pack_groups``)."""
    correction = get_rollout_correction(config.algo.rollout_correction.mode)
    missing = batch.engine_logprobs.isnan() & (batch.loss_mask > 0)
    if correction.applies and bool(missing.any()):
        samples = int(batch.sample_index[missing].unique().numel())
        raise RuntimeError(
            f"algo.rollout_correction.mode={correction.name!r}: {samples} sample(s) of step "
            f"{step} came from the engine without one log-prob per response token "
            f"({config.rollout.backend!r} backend), and the correction needs them; use an "
            "engine that returns them or set algo.rollout_correction.mode=none"
        )


def prepare_batch(s: Session, groups: list[Group], step: int) -> TrainBatch:
    """The step's accepted groups with their advantages, packed for the trainer; refused when
    a rollout correction lacks the engine's log-probs (:func:`require_engine_logprobs`)."""
    assign_configured_advantages(groups, s.config.algo)
    batch = pack_groups(groups)
    require_engine_logprobs(s.config, batch, step)
    return batch


def submit_logprobs(s: Session, batch: TrainBatch, step: int, old_weights: str = "policy"
                    ) -> Pending:  # fmt: skip
    """Queue the step's one log-prob call on the trainer ranks: old log-probs (the live weights,
    or the ``behavior`` copy a one-step-off batch was drawn with) and reference log-probs, and
    the exact-KL diagnostic when it is due (:func:`finish_logprobs`)."""
    return s.trainer.submit_logprobs(
        batch, needs_reference_logprobs(s.config.algo), exact_kl_tokens(s, batch, step),
        old_weights,
    )  # fmt: skip


def finish_logprobs(s: Session, batch: TrainBatch, pending: Pending) -> dict[str, float]:
    """Wait for :func:`submit_logprobs`; fill ``old_logprobs`` and ``ref_logprobs`` of the
    driver's ``batch`` (the ranks filled their own copies); the exact-KL metrics."""
    with nvtx_range("logprobs/step"):
        old, ref, exact_kl = pending.result()
    batch.old_logprobs = old
    if ref is not None:
        batch.ref_logprobs = ref
    return exact_kl


def exact_kl_tokens(s: Session, batch: TrainBatch, step: int) -> torch.Tensor | None:
    """Every ``logging.exact_kl_every`` steps, the tokens of the exact KL(pi_old || pi_ref)
    and KL(pi_ref || pi_old) diagnostic over the vocabulary: a few on-policy samples, before
    the update (like ``kl/reverse_k1``); else ``None``."""
    log = s.config.logging
    if log.exact_kl_every <= 0 or step % log.exact_kl_every:
        return None
    return exact_kl_mask(batch, log.exact_kl_samples, log.exact_kl_positions)


def submit_minibatches(s: Session, groups: list[Group]) -> list[Pending]:
    """Queue one optimizer update per mini-batch of ``trainer.ppo_mini_batch`` queries on the
    trainer ranks, on the batch they keep from :func:`submit_logprobs` (nothing is sent again
    but each mini-batch's sample ids), right behind that call: a rank runs its calls in order,
    so the updates follow the log-probs and each other with no driver round trip. The policy's
    weight push of ``step`` is queued behind them by :func:`run_step`
    (:meth:`~megatron_armor.orchestration.actors.weight_sync.WeightSync.queue_policy_push`)."""
    per_update = groups_per_update(s.config)
    return s.trainer.submit_updates(minibatch_sample_ids(groups, s.num_minibatches, per_update))


def finish_minibatches(s: Session, queued: list[Pending]) -> dict[str, float]:
    """Wait for the updates of :func:`submit_minibatches`; their reduced metrics, with the
    skipped updates counted (``update_guard.skip_metrics``; the count in a row goes into the
    run state, which the checkpoint keeps)."""
    s.progress.start("train", len(queued))
    updates = []
    for update in queued:
        updates.append(update.result())
        s.progress.advance()
    s.progress.close()
    skips, s.state.skipped_in_a_row = skip_metrics(updates, s.state.skipped_in_a_row)
    return {**reduce_update_metrics(updates), **skips}


def train_metrics(
    s: Session, batch: TrainBatch, metrics: dict[str, float], exact_kl: dict[str, float]
) -> dict[str, float]:
    """``metrics`` of the step's updates (:func:`finish_minibatches`) with the exact KL, the
    engine/trainer log-prob agreement and the response and prompt tokens trained; the
    throughput meter counts the step's sequences."""
    s.meter.add_train(batch.seq_lengths(), s.timers.seconds("train"))
    metrics.update(exact_kl)
    metrics.update(logprob_mismatch_metrics(batch, needs_reference_logprobs(s.config.algo)))
    metrics["train/response_tokens"] = float(batch.num_response_tokens)
    metrics["train/prompt_tokens"] = float(batch.num_tokens - batch.num_response_tokens)
    return metrics


def heal_before_push(s: Session, step: int) -> int:
    """Servers that died while the trainer worked come back (with the weights they served)
    before the push, which would otherwise fail on them; not ``colocated``, where the engines
    released their memory and cannot answer a health check (it generates a token)."""
    if s.config.orchestration.layout == "colocated":
        return 0
    return s.heal_rollout(step)


def sync_and_maybe_reset(s: Session, step: int, updated: bool = True) -> dict[str, float]:
    """Weight sync (version = step); then a reference reset if the schedule says so. A step
    whose every update was skipped (``updated`` false: non-finite, docs/trainer.md) keeps the
    version of the step before (``WeightSync.skip_policy_push``: colocated SGLang servers, which
    released their weights, get them pushed again). Colocated: every trainer rank hands its
    memory over (update state out when offloaded, cached blocks returned) before the engines
    take their weights' memory back, and the engines take their KV cache after the pushes, so
    the cache is not on the GPUs beside the pushes' buckets (docs/weight-sync.md)."""
    colocated = s.config.orchestration.layout == "colocated"
    with s.timers.phase("sync"):
        if colocated or s.config.trainer.offload_train_state:
            s.trainer.hand_over_memory()
        if colocated:
            s.rollout.memory.resume(["weights"])
        if updated:  # trainer ranks -> engines (actors/weight_sync.py); a dead worker is replaced
            num_bytes = s.recovery.guard(s, step, "sync", lambda: s.push_policy(step))
            s.state.policy_version = step
        else:
            num_bytes = s.recovery.guard(s, step, "sync", s.weight_sync.skip_policy_push)
    s.meter.add_weight_sync(s.timers.seconds("sync"), num_bytes)
    reset = s.schedule.should_reset(step)
    if reset:
        with s.timers.phase("reset"):
            s.trainer.reset_reference()
            # the trainer's reference is now the policy (once: only the push is guarded)
            s.recovery.guard(s, step, "reset", lambda: s.push_reference(step, reset=True))
            s.schedule.record_reset(step)
            s.state.ref_version = step
    if colocated:
        s.rollout.memory.resume(["kv_cache"])
    return {"reset/performed": float(reset), "reset/ref_version": float(s.state.ref_version)}


def validate(s: Session, step: int) -> dict[str, float]:
    """``val/<bench>/<metric>`` (avg@k, pass@k, maj@k) with the validation sampling settings."""
    from megatron_armor.evaluation.runner import evaluate

    v, seed = s.config.validation, derive_seed(s.config.run.seed, step, 0, "validation")
    params = SamplingParams(temperature=v.temperature, top_p=v.top_p,
                            max_new_tokens=s.config.rollout.sampling.max_new_tokens, seed=seed)  # fmt: skip
    engine, scorer = RemoteEngine(s.rollout.policy, seed), RemoteScorer(s.reward)
    run = lambda: evaluate(engine, s.val_datasets, scorer,  # noqa: E731
                           v.n_samples, params, v.max_problems, tokenizer=s.tokenizer)  # fmt: skip
    with s.timers.phase("validate"):
        results = s.recovery.guard(s, step, "validation", run)  # a dead worker: replaced, again
    k = v.n_samples
    return {f"val/{bench}/{key.replace('@k', f'@{k}')}": float(x)
            for bench, r in results.items() for key, x in r.items()}  # fmt: skip


def validation_due(config: ArmorConfig, step: int) -> bool:
    every = config.validation.every
    return every > 0 and (step % every == 0 or step == config.run.steps)


def checkpoint_due(config: ArmorConfig, step: int) -> bool:
    """Every ``run.ckpt_every`` steps (0 = only at the end) and at the last step."""
    every = config.run.ckpt_every
    return step == config.run.steps or (every > 0 and step % every == 0)
