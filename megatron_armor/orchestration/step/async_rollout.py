"""One-step-off asynchronous rollout: the next step's generation beside this step's updates.

``orchestration.async_rollout: one_step`` (docs/orchestration.md, "Asynchronous rollout").
While the trainer ranks run step t (old/ref log-probs, the updates, the export of the new
weights), a driver thread draws step t+1's accepted groups (:class:`Collector`) from engines
that still serve the weights of step t-1; the two meet before step t's weight push::

    step t    trainer:  logprobs(t) -> keep weights as `behavior` -> updates(t) -> export
              engines:  collect(t+1) on the weights of step t-1 ..........|
              then:     push(t) -> reset? -> validate? -> checkpoint (holds the batch t+1)
    step t+1  trainer:  logprobs(t+1) with `old` under `behavior` -> keep -> updates(t+1)
              engines:  collect(t+2) on the weights of step t ...

ARMOR stays exact under three rules:

- **Anchors from the valid reference.** The reference only changes at a reset, and a step
  that resets does not overlap: step t+1's rollout starts after step t's reset, so every
  anchor comes from the reference the step that trains on it uses (``async/drained`` 1). The
  last step drains too (there is no next one).
- **The behavior policy in the ratio.** The mixed ratio's ``old`` term is each sample's
  behavior policy: a one-step-off batch's ``old`` pass runs under the weights the engines
  generated it with, which the ranks keep (``MegatronTrainer.snapshot_behavior``) before the
  updates that follow; a batch drawn after a drain (version lag 0) uses the live weights, as
  the synchronous loop does. The engine/trainer log-prob agreement of policy tokens
  (``rollout/policy_logprob_absdiff_*``) checks it every step.
- **Staleness bound one.** Policy samples are at most one pushed version old
  (``async/version_lag_max``); the batch of step t+1 is drawn entirely on one version (the
  push waits for the rollout), so a batch never mixes versions.

Exact resume: a checkpoint of step t holds the batch of step t+1 (:func:`collected_state`,
in the types the safe loader reads) and the ranks' behavior weights (``trainer/checkpoint.py``);
the sampler and the rollout workers' state are those after that batch's rollout. A resumed run
trains that batch next and draws step t+2 exactly as the uninterrupted run does (the seeds
derive from ``(run.seed, step, batch)``), so every step's metrics are the same.

Sampling order (``rollout.reference_first: auto``) follows the rollout metrics of the step
before, as in the synchronous loop; the reference prefetch (``rollout.prefetch_reference``) has
nothing left to do: the whole next rollout overlaps the updates (it applies to drained steps
only, which are reset steps, where it never applies).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field

from megatron_armor.algo.anchors import AcceptanceStats
from megatron_armor.observability.timers import PhaseTimers
from megatron_armor.orchestration.actors.call_watch import POLL_S
from megatron_armor.orchestration.step import phases
from megatron_armor.orchestration.step.anchor_rollout import AnchorRollout, RolloutResult
from megatron_armor.orchestration.step.step_metrics import (
    rollout_metrics,
    write_anchor_file,
)
from megatron_armor.rollout.backends import backend_of
from megatron_armor.trainer.weight_store import BEHAVIOR
from megatron_armor.types import SampleSource, group_from_dict, sample_from_dict


@dataclass
class Collected:
    """One step's rollout, drawn ahead of the step that trains on it."""

    step: int
    result: RolloutResult
    metrics: dict[str, float] = field(default_factory=dict)
    """Read right after the rollout: the sampler's ``data/*`` and the anchor cache's counters."""
    timings: dict[str, float] = field(default_factory=dict)
    """``timing/rollout_s``, ``timing/generate_s``, ``timing/score_s`` of this rollout."""
    version: int = 0
    """The policy version the engines served while drawing it."""
    old_weights: str = "policy"
    """The trainer weights of its ``old`` pass: ``policy`` (drawn on them) or ``behavior``."""
    seconds: float = 0.0
    """Wall time of the rollout."""
    ended: float = 0.0
    """``time.perf_counter()`` at its end (this process only; 0 after a resume)."""


# ---------------------------------------------------------------------------- checkpointing
def collected_state(c: Collected | None) -> dict:
    """``c`` in the types ``torch.load(weights_only=True)`` reads: the rollout as JSON text
    (floats round-trip exactly) and the rest as numbers; ``{}`` for none."""
    if c is None:
        return {}
    return {
        "step": c.step, "result": json.dumps(dataclasses.asdict(c.result)),
        "metrics": dict(c.metrics), "timings": dict(c.timings), "version": c.version,
        "old_weights": c.old_weights, "seconds": c.seconds,
    }  # fmt: skip


def result_from_dict(d: dict) -> RolloutResult:
    """The :class:`RolloutResult` of ``dataclasses.asdict`` (after a JSON round trip)."""
    groups = [group_from_dict(g) for g in d["groups"]]
    return RolloutResult(**{
        **d, "groups": groups, "stats": AcceptanceStats(**d["stats"]),
        "policy_samples": [sample_from_dict(x) for x in d["policy_samples"]],
    })  # fmt: skip


def collected_from_state(state: dict) -> Collected | None:
    """The inverse of :func:`collected_state`."""
    if not state:
        return None
    return Collected(
        step=int(state["step"]), result=result_from_dict(json.loads(state["result"])),
        metrics=dict(state["metrics"]), timings=dict(state["timings"]),
        version=int(state["version"]), old_weights=str(state["old_weights"]),
        seconds=float(state["seconds"]),
    )  # fmt: skip


# ---------------------------------------------------------------------------- the collector
class Collector:
    """Draws a step's rollout now (:meth:`collect`) or on a driver thread (:meth:`launch`,
    :meth:`join`). The rollout's phases are timed on its own timers, so each step's line
    carries the timings of the rollout it trained on."""

    def __init__(self, session, rollout: AnchorRollout, timers: PhaseTimers):
        self.s, self.rollout, self.timers = session, rollout, timers
        self._thread: threading.Thread | None = None
        self._outcome: tuple | None = None

    def collect(self, step: int, version: int, old_weights: str) -> Collected:
        """Step ``step``'s rollout (the engines at policy ``version``), in this thread."""
        s, start = self.s, time.perf_counter()
        with self.timers.phase("rollout"):
            # drawn again if a worker dies (orchestration/actors/recovery.py); the cache
            # counters' read is queued
            result, counters = s.recovery.collect(s, self.rollout, step)
        metrics = dict(s.sampler.metrics())  # data/epoch, data/retired*
        metrics.update(s.rollout.reference.metrics(counters))
        timings = self.timers.pop_metrics()
        end = time.perf_counter()
        return Collected(step, result, metrics, timings, version, old_weights, end - start, end)

    def launch(self, step: int, version: int, old_weights: str) -> None:
        """Start :meth:`collect` on a daemon thread (a run that fails meanwhile is not held
        at exit by a thread waiting on Ray)."""

        def run():
            try:
                self._outcome = (self.collect(step, version, old_weights), None)
            except BaseException as err:  # noqa: BLE001 - raised again in join()
                self._outcome = (None, err)

        self._outcome = None
        self._thread = threading.Thread(target=run, name=f"rollout-step-{step}", daemon=True)
        self._thread.start()

    def join(self) -> Collected:
        """Wait for :meth:`launch`'s rollout; its failure is raised here, in the loop's thread.
        A watchdog bounds the wait for a batch that never comes: every call of the thread has
        its deadline (``orchestration/actors/call_watch.py``), the thread itself gets the cap
        (a ``TimeoutError``: exit 75) and a stop signal ends the wait after ``stop_wait_s``."""
        start, thread, watch = time.monotonic(), self._thread, self.s.call_watch
        while thread.is_alive():
            watch.check_stop(f"the rollout thread ({thread.name})", start)
            waited = time.monotonic() - start
            if waited > watch.cap():
                raise TimeoutError(
                    f"the rollout thread ({thread.name}) gave no batch within {waited:.0f}s "
                    "(the call deadlines' cap)"
                )
            thread.join(POLL_S)
        self._thread = None
        collected, err = self._outcome
        self._outcome = None
        if err is not None:
            raise err
        return collected


# ---------------------------------------------------------------------------- one step
def lag_metrics(result: RolloutResult, trainer_version: int) -> dict[str, float]:
    """``async/version_lag_{mean,max}``: pushed policy versions between each trained policy
    sample's weights and the trainer's at the step's start."""
    lags = [trainer_version - x.weight_version for g in result.groups for x in g.samples
            if x.source == SampleSource.POLICY]  # fmt: skip
    if not lags:
        return {}
    return {"async/version_lag_mean": sum(lags) / len(lags), "async/version_lag_max": max(lags)}


class AsyncPipeline:
    """The loop's step with ``orchestration.async_rollout: one_step`` (module docstring)."""

    def __init__(self, session, rollout: AnchorRollout, timers: PhaseTimers, pending=None):
        self.s = session
        self.rollout = rollout
        self.collector = Collector(session, rollout, timers)
        self.pending: Collected | None = pending

    def in_flight(self) -> dict:
        """The next step's rollout, drawn during this step, as a checkpoint keeps it."""
        return collected_state(self.pending)

    def overlaps(self, step: int) -> bool:
        """Whether step ``step + 1``'s rollout runs beside step ``step``'s updates: not at the
        last step, and not at a reset step (the next anchors need the new reference)."""
        return step < self.s.config.run.steps and not self.s.schedule.should_reset(step)

    def run_step(self, step: int) -> dict[str, float]:
        """One step; leaves the next step's rollout in :attr:`pending` when it overlapped (a
        checkpoint of the step keeps it: :meth:`in_flight`)."""
        s, t0 = self.s, time.perf_counter()
        restarted = 0
        batch, self.pending = self.pending, None
        if batch is None:  # the first step, a resume after a drained step, or after a drain
            restarted += s.heal_rollout(step)
            batch = self.collector.collect(step, s.state.policy_version, "policy")
        waited = time.perf_counter() - t0  # the trainer's wait for this step's batch
        if batch.step != step:
            raise RuntimeError(f"the rollout in flight is of step {batch.step}, not {step}")
        result, overlap = batch.result, self.overlaps(step)
        if overlap:
            restarted += s.heal_rollout(step + 1)  # before the engines get step t+1's calls
        metrics = dict(phases.NO_UPDATE)
        train_start = time.perf_counter()
        # the ranks: log-probs (old under the batch's behavior weights), then keep the live
        # weights as the next batch's behavior weights, then the updates (in this order)
        queued, kept = None, None
        if result.groups:
            queued, kept = self.submit_train(step, batch, overlap)
        elif overlap:
            kept = s.trainer.submit_snapshot_behavior()
        metrics.update(rollout_metrics(result))  # after the advantages (submit_train)
        if overlap:
            # the order rule reads the step before's rollout (no reset: none in an overlap)
            self.rollout.observe({**metrics, **batch.metrics, "reset/performed": 0.0})
            s.recovery.serve(BEHAVIOR)  # what a replaced rollout worker gets meanwhile
            self.collector.launch(step + 1, s.state.policy_version, BEHAVIOR)
        write_anchor_file(s.run_dir, step, result)
        if queued is not None:
            metrics.update(finish_train(s, step, queued, load_early=not overlap))
        if kept is not None:
            kept.result()
        train_end = time.perf_counter()
        if overlap:
            with s.timers.step_phase("rollout/wait"):  # the updates are done: waiting
                self.pending = self.collector.join()
            s.recovery.serve("policy")
        join_end = time.perf_counter()
        metrics.update(batch.metrics)
        metrics.update(batch.timings)
        s.meter.add_rollout(result.generated_tokens, batch.timings.get("timing/generate_s", 0.0))
        metrics.update(lag_metrics(result, s.state.policy_version))
        metrics.update(self.overlap_metrics(waited, train_start, train_end, join_end, overlap))
        restarted += phases.heal_before_push(s, step)
        updated = metrics["train/updates"] > metrics.get("train/skipped_updates", 0.0)
        metrics.update(phases.sync_and_maybe_reset(s, step, updated))
        metrics["algo/alpha"] = s.config.resolved.alpha
        if backend_of(s.config).serves_over_http:  # and those killed past a call deadline
            restarted += s.recovery.pop_servers_restarted()
            metrics["rollout/servers_restarted"] = float(restarted)
        if phases.validation_due(s.config, step):
            metrics.update(phases.validate(s, step))
        if not overlap:
            self.rollout.observe(metrics)  # the next rollout comes after this step, as in sync
        return metrics

    def overlap_metrics(self, waited, train_start, train_end, join_end, overlap):
        """``async/rollout_wait_s`` (the trainer waiting for rollouts: this step's batch drawn
        now, or the next one still drawing after the updates), ``async/trainer_wait_s`` (the
        next rollout done, waiting for the updates), ``async/overlap_s`` (both at work) and
        ``async/drained``; ``async/overlap_fraction`` follows in :func:`overlap_fraction`."""
        out = {"async/drained": float(not overlap), "async/rollout_wait_s": waited,
               "async/trainer_wait_s": 0.0, "async/overlap_s": 0.0}  # fmt: skip
        if overlap:
            ended = self.pending.ended
            out["async/rollout_wait_s"] += join_end - train_end
            out["async/trainer_wait_s"] = max(0.0, train_end - ended)
            out["async/overlap_s"] = max(0.0, min(ended, train_end) - train_start)
        return out

    def submit_train(self, step: int, batch: Collected, keep: bool):
        """The trainer calls of the step, sent now: the log-prob call, the behavior weights
        kept for the next batch (``keep``), the updates. Returns ``((batch, log-probs,
        updates), the kept weights' call or None)``, each call a ``Pending``."""
        s, groups = self.s, batch.result.groups
        packed = phases.prepare_batch(s, groups, step)
        with s.timers.phase("logprobs"):
            logprobs = phases.submit_logprobs(s, packed, step, batch.old_weights)
        kept = s.trainer.submit_snapshot_behavior() if keep else None
        with s.timers.phase("train"):
            updates = phases.submit_minibatches(s, groups)
        return (packed, logprobs, updates), kept


def finish_train(s, step: int, queued, load_early: bool) -> dict:
    """Wait for a step's queued log-probs and updates (``queued``: the packed batch, the
    log-prob call, the updates), with the weight export queued behind them (the engines load
    it only after the next rollout: ``load_early`` off in an overlap); the train metrics."""
    packed, logprobs, updates = queued
    with s.timers.phase("logprobs"):
        exact_kl = phases.finish_logprobs(s, packed, logprobs)
    with s.timers.phase("train"):
        s.weight_sync.queue_policy_push(step, load_early=load_early)
        metrics = phases.finish_minibatches(s, updates)
    return phases.train_metrics(s, packed, metrics, exact_kl)


def overlap_fraction(metrics: dict[str, float]) -> None:
    """``async/overlap_fraction``: the share of the step's wall time in which the rollout and
    the trainer both worked (``async/overlap_s / timing/step_s``)."""
    if "async/overlap_s" in metrics and metrics.get("timing/step_s"):
        metrics["async/overlap_fraction"] = metrics["async/overlap_s"] / metrics["timing/step_s"]
