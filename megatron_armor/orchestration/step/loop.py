"""The ARMOR training loop (Algorithm 1) as a short sequence of verbs on actor handles.

Per step: generate -> score -> accept (anchor rollout, docs/algorithm.md, anchor rollout) -> advantages (§3) ->
pack -> old/ref log-probs -> train (``B / ppo_mini_batch`` updates, §4) -> weight sync ->
maybe reset the reference (§5) -> maybe validate -> maybe checkpoint (it carries the step's
metrics line) -> log. A SIGTERM, SIGINT or SIGUSR1 finishes the step, checkpoints and exits
with code 75 for a Slurm requeue; ``trainer.max_skipped_updates`` non-finite updates in a row
checkpoint the step and stop the run with a ``DivergedError`` (exit 65, no requeue). A dead
rollout or reward worker is replaced and the interrupted part of the step done again
(``orchestration/actors/recovery.py``); a fault the run cannot recover from in place exits 75
(``orchestration/actors/faults.py``).
With ``orchestration.async_rollout: one_step`` the step is ``async_rollout.AsyncPipeline``'s:
the next step's rollout runs beside the updates.
"""

from __future__ import annotations

import sys
import time

import torch

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.validate import runs_async_rollout, runs_bounded_staleness
from megatron_armor.data.sampler import SamplerExhausted
from megatron_armor.observability.facts import run_facts, write_facts
from megatron_armor.observability.metrics import metrics_record
from megatron_armor.observability.signal_lead import SignalLeadWatch
from megatron_armor.observability.status import StepClock
from megatron_armor.observability.summary import step_line
from megatron_armor.observability.throughput import e2e_devices, e2e_metrics
from megatron_armor.observability.timers import PhaseTimers
from megatron_armor.orchestration.actors.call_watch import CallWatch, StopDuringCallError
from megatron_armor.orchestration.actors.faults import RequeueError, locate, requeue_error
from megatron_armor.orchestration.actors.placement import plan_layout, shutdown_ray
from megatron_armor.orchestration.actors.recovery import WHY_TRAINER, handles
from megatron_armor.orchestration.run import checkpoints
from megatron_armor.orchestration.run.disk_space import DiskFullError, full_disk_error
from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE, StopSignal
from megatron_armor.orchestration.run.session import Session, run_dir_of
from megatron_armor.orchestration.step.acceptance import (
    EXIT_ACCEPTANCE,
    AcceptanceError,
    exit_message,
)
from megatron_armor.orchestration.step.anchor_rollout import AnchorRollout
from megatron_armor.orchestration.step.async_rollout import (
    AsyncPipeline,
    collected_from_state,
    overlap_fraction,
)
from megatron_armor.orchestration.step.bounded_rollout import BoundedPipeline, holds_next_rollout
from megatron_armor.orchestration.step.phases import (
    NO_UPDATE,
    checkpoint_due,
    finish_logprobs,
    finish_minibatches,
    heal_before_push,
    prepare_batch,
    submit_logprobs,
    submit_minibatches,
    sync_and_maybe_reset,
    train_metrics,
    validate,
    validation_due,
)
from megatron_armor.orchestration.step.step_metrics import (
    rollout_metrics,
    write_anchor_file,
)
from megatron_armor.orchestration.step.update_guard import diverged_error
from megatron_armor.rollout.backends import backend_of
from megatron_armor.supervisor_pipe import (
    SIGNAL_CAUSE,
    UNWATCHED,
    report_phase,
    report_rule,
    tell_supervisor,
)


def run_step(s: Session, rollout: AnchorRollout, step: int) -> dict[str, float]:
    """One step of Algorithm 1; returns its metrics (without timings). A step that accepted
    no query (a short batch under ``algo.min_batch_fraction: 0``) makes no update, and a step
    without an applied update keeps the version before (``phases.sync_and_maybe_reset``)."""
    restarted = s.heal_rollout(step)  # dead SGLang servers come back with current weights
    s.progress.start(f"step {step} rollout", s.config.rollout.batch)
    with s.timers.phase("rollout"):
        # drawn again if a worker dies; the cache counters' read is waited for later
        result, cache_counters = s.recovery.collect(s, rollout, step)
    s.progress.close()
    if s.config.orchestration.layout == "colocated":
        s.rollout.memory.release()
    if result.groups:
        metrics = train_on(s, rollout, step, result)
    else:
        write_anchor_file(s.run_dir, step, result)
        metrics = dict(NO_UPDATE)
    s.meter.add_rollout(result.generated_tokens, s.timers.seconds("generate"))
    metrics.update(rollout_metrics(result))
    metrics.update(s.sampler.metrics())  # data/epoch, data/retired*
    metrics.update(s.rollout.reference.metrics(cache_counters))
    restarted += heal_before_push(s, step)
    updated = metrics["train/updates"] > metrics.get("train/skipped_updates", 0.0)
    metrics.update(sync_and_maybe_reset(s, step, updated))
    metrics["algo/alpha"] = s.config.resolved.alpha
    if backend_of(s.config).serves_over_http:  # and those killed past a call deadline
        restarted += s.recovery.pop_servers_restarted()
        metrics["rollout/servers_restarted"] = float(restarted)
    if validation_due(s.config, step):
        metrics.update(validate(s, step))
    rollout.observe(metrics)  # rollout.reference_first=auto: the next step's order
    return metrics


def train_on(s: Session, rollout: AnchorRollout, step: int, result) -> dict[str, float]:
    """Advantages, packing, the log-prob call and the step's updates on ``result.groups``
    (with the next step's reference prefetch and the policy push queued between them); the
    trainer's metrics, the exact KL and the engine/trainer log-prob agreement."""
    batch = prepare_batch(s, result.groups, step)
    prefetch = step < s.config.run.steps and not s.schedule.should_reset(step)
    # a CPU rank's concurrent reference pass takes the engine's core: the prefetch waits for it
    after_logprobs = s.config.resolved.concurrent_reference
    with s.timers.phase("logprobs"):
        logprobs = submit_logprobs(s, batch, step)
    if prefetch and not after_logprobs:
        rollout.prefetch(step, result)  # before the weight push queued on the engines
    with s.timers.phase("train"):
        updates = submit_minibatches(s, result.groups)  # queued behind the log-probs
    write_anchor_file(s.run_dir, step, result)  # while the ranks work
    with s.timers.phase("logprobs"):
        exact_kl = finish_logprobs(s, batch, logprobs)
    if prefetch and after_logprobs:
        rollout.prefetch(step, result)  # beside the updates
    with s.timers.phase("train"):
        # behind the updates on the ranks and behind the prefetched call on the engines (which
        # run their calls in order: queued first, the load would hold the call back)
        s.weight_sync.queue_policy_push(step)
        metrics = finish_minibatches(s, updates)
    return train_metrics(s, batch, metrics, exact_kl)


def finish_timing(s: Session, metrics: dict[str, float], t0: float) -> None:
    """The step's wall-clock figures so far: its timers, ``timing/step_s`` since ``t0``, the
    seconds of each phase (``phase/*``, summing to it), the end-to-end tokens/s/GPU and the
    one-step-off overlap share. Again after a checkpoint, which the step's time includes."""
    metrics.update(s.timers.pop_metrics())
    end = time.perf_counter()  # one reading for both: a pause between two would split them
    metrics["timing/step_s"] = end - t0
    metrics.update(s.timers.clock.metrics(end))
    metrics.update(e2e_metrics(metrics, e2e_devices(s.config)))
    overlap_fraction(metrics)


def stop_message(s: Session, stop: StopSignal, saved: bool) -> str:
    """What a signal did, with the newest checkpoint as it is on disk."""
    newest = checkpoints.list_checkpoints(s.run_dir)
    if saved and newest:
        return (f"{stop.name}: checkpoint of step {newest[-1][0]} written ({newest[-1][1]}); "
                f"exiting {EXIT_REQUEUE} (requeue to resume)")  # fmt: skip
    where = f"step {newest[-1][0]} ({newest[-1][1]})" if newest else "none, a requeue starts over"
    return (f"{stop.name} before the next step: no step run; newest checkpoint: {where}; "
            f"exiting {EXIT_REQUEUE} (requeue to resume)")  # fmt: skip


def run_loop(s: Session, start: int, stop: StopSignal) -> int:
    """Steps ``start + 1 .. run.steps``; returns the process exit code (0, or 75 on a signal).
    After ``trainer.max_skipped_updates`` non-finite updates in a row it checkpoints the step
    and raises :class:`~megatron_armor.orchestration.step.update_guard.DivergedError`.

    A signal during a step (its logging included) lets the step finish, then checkpoints it;
    one that arrives before the first step (start-up, restore, step-0 validation) stops
    before it without writing anything."""
    cfg = s.config
    if start >= cfg.run.steps:
        print(f"{s.run_dir} is complete at step {start} (run.steps={cfg.run.steps}); "
              "raise run.steps to continue it", flush=True)  # fmt: skip
        return 0
    if s.watch.stopped:
        print(f"{s.run_dir}: {s.watch.stop_line()}; nothing left to train", flush=True)
        return 0
    resumed_at_0 = bool(s.state.watch)
    # the resumed state: that after the rollout of the step in flight, if one is
    ahead = start + 1 if holds_next_rollout(s.state.pending) else start
    s.recovery.settle_snapshot(s.recovery.submit_snapshot(s), ahead)
    if start == 0 and cfg.validation.every > 0 and not resumed_at_0 and not stop.received:
        report_phase("validation", 0)
        initial = validate(s, 0)
        initial.update(s.watch.observe(0, initial))
        line = metrics_record(0, {**initial, **s.timers.pop_metrics()})
        s.logger.write(line)
        if s.watch.wants_checkpoint:  # the start model is the best so far (run.keep_best)
            s.save(0, line)
    pipeline = None
    if runs_async_rollout(cfg) or runs_bounded_staleness(cfg):  # own timers, no progress bar
        timers = PhaseTimers(s.timers.clock)  # a batch drawn in the step's thread is its time
        if runs_bounded_staleness(cfg):
            pipeline = BoundedPipeline.start(s, timers, s.state.pending)
            rollout = pipeline.draw
        else:
            rollout = AnchorRollout(cfg, s.dataset, s.sampler, s.rollout.policy,
                                    s.rollout.reference, s.reward, None, timers)  # fmt: skip
            pipeline = AsyncPipeline(s, rollout, timers, collected_from_state(s.state.pending))
    else:
        rollout = AnchorRollout(cfg, s.dataset, s.sampler, s.rollout.policy, s.rollout.reference,
                                s.reward, s.progress.rollout_update, s.timers)  # fmt: skip
    rollout.observe(s.state.metrics_line)  # resumed: the checkpointed step's line
    clock = StepClock()  # the step line's ETA
    lead = SignalLeadWatch.from_environment()  # does a checkpoint fit in the signal's lead?
    for step in range(start + 1, cfg.run.steps + 1):
        if stop.received:
            return stopped(stop_message(s, stop, saved=False))
        report_phase("step", step)
        t0 = time.perf_counter()
        s.timers.clock.start()  # every second from here on goes to one phase (phase/*)
        s.trainer.profile_begin(step)
        s.rollout.fleet.profile_begin(step)  # its workers' and servers' capture of the step
        metrics = pipeline.run_step(step) if pipeline else run_step(s, rollout, step)
        s.rollout.fleet.profile_end(step)
        s.trainer.profile_end(step)
        metrics.update(s.meter.pop_metrics())
        metrics.update(s.weight_sync.pop_metrics())
        metrics.update(s.call_watch.pop_metrics())  # faults/stuck_*: actors killed past a deadline
        metrics.update(s.gpu_memory_metrics())
        metrics.update(s.host_metrics(checkpoint_due(cfg, step)))
        metrics.update(s.watch.observe(step, metrics))
        finish_timing(s, metrics, t0)
        diverged = s.state.skipped_in_a_row >= cfg.trainer.max_skipped_updates
        saved = stop.received or checkpoint_due(cfg, step) or s.watch.wants_checkpoint or diverged
        if saved:  # the line travels in the checkpoint: a kill before it is appended loses nothing
            report_phase("checkpoint")
            with s.timers.phase("checkpoint"):
                written = s.save(step, metrics_record(step, metrics), in_flight(pipeline))
            finish_timing(s, metrics, t0)
        report_phase("log")
        line = metrics_record(step, metrics)
        clean = s.logger.write(line)
        clock.observe(metrics["timing/step_s"])
        print(step_line(step, cfg.run.steps, clean, clock.eta(step, cfg.run.steps)), flush=True)
        saving_s = metrics.get("timing/checkpoint_s") if saved else None
        lead_warning = lead.observe(metrics["timing/step_s"] - (saving_s or 0.0), saving_s)
        if lead_warning:
            print(lead_warning, flush=True)
        if diverged:
            raise diverged_error(cfg, step, metrics, str(written))
        if stop.received and step < cfg.run.steps:
            if not saved:  # the signal came while the step was being logged
                s.save(step, line, in_flight(pipeline))
            return stopped(stop_message(s, stop, saved=True))
        if s.watch.stopped:
            print(f"{s.watch.stop_line()}; checkpoint of step {step} written", flush=True)
            return 0
    return 0


def in_flight(pipeline: AsyncPipeline | BoundedPipeline | None) -> dict:
    """The next step's rollout drawn during this one, as a checkpoint keeps it (``{}``: none)."""
    return pipeline.in_flight() if pipeline is not None else {}


def run_with_faults(s: Session, stop: StopSignal) -> int:
    """Restore and run the loop; a fault the run cannot recover from in place (a trainer rank
    died, or one of the cases of ``orchestration/actors/recovery.py``) prints why, the newest
    complete checkpoint and ``--resume auto``, and exits 75 (requeue:
    ``orchestration/actors/faults.py``)."""
    try:
        return run_loop(s, s.restore(), stop)
    except StopDuringCallError as err:
        tell_supervisor("cause", SIGNAL_CAUSE)
        print(f"armor train: {err}", file=sys.stderr, flush=True)
    except RequeueError as err:
        tell_supervisor("cause", requeue_cause(locate(err.__cause__, handles(s)), err))
        print(f"armor train: {err}", file=sys.stderr, flush=True)
    except Exception as err:
        full = full_disk_error(s.run_dir, err)  # an anchor file, metrics, TensorBoard
        if full is not None and not isinstance(err, DiskFullError):
            raise full from err
        fault = locate(err, handles(s))
        if fault is None:
            raise
        why = (
            WHY_TRAINER if fault.kind == "trainer" else "it failed outside the calls a step repeats"
        )
        tell_supervisor("cause", requeue_cause(fault, err))
        print(f"armor train: {requeue_error(s.run_dir, fault, s.recovery.step, why)}",
              file=sys.stderr, flush=True)  # fmt: skip
    return EXIT_REQUEUE


def stopped(message: str) -> int:
    """Print why a stop signal ends the run here, tell the parent it was a signal (never a
    requeue loop); exit 75."""
    print(message, flush=True)
    tell_supervisor("cause", SIGNAL_CAUSE)
    return EXIT_REQUEUE


def requeue_cause(fault, err: BaseException) -> str:
    """What a requeue for ``err`` would meet again: the fault's actor and error class (no
    pids or times: ``requeue_history.py`` compares the causes of successive exits)."""
    if fault is None:
        return type(err).__name__
    return f"{fault.actor} failed ({type(fault.error).__name__})"


def report_start(config: ArmorConfig) -> None:
    """The run's deadline settings and directory to the ``armor`` parent that watches the
    driver (``cli/driver_watch.py``); the start-up phase begins."""
    o = config.orchestration
    report_rule(o.call_deadline_multiple, o.call_deadline_quantile, o.call_deadline_floor_s,
                o.call_deadline_cap_s, o.stop_wait_s)  # fmt: skip
    tell_supervisor("run_dir", run_dir_of(config))
    report_phase("start", 0)


def record_facts(s: Session) -> None:
    """``RUN_DIR/report_facts.json``: the hardware and peaks ``armor report`` measures this
    start of the run against (``observability/facts.py``)."""
    cores = plan_layout(s.config).threads  # a CPU trainer rank's torch threads
    device = s.trainer.info.get("device_name", "cpu")
    write_facts(s.run_dir, run_facts(s.config, device, cores))


def start_line(config: ArmorConfig) -> str:
    """What the driver prints once the run directory is its own (locked, resume decided)."""
    return (f"armor train: starting {run_dir_of(config)} (SIGTERM, SIGINT, SIGUSR1: "
            f"checkpoint and exit {EXIT_REQUEUE})")  # fmt: skip


def train(config: ArmorConfig, resume: str = "auto") -> int:
    """Run (or resume) a training run end to end; returns the process exit code.

    The stop signals are handled from the first line on; one that arrives during start-up
    stops the run before its first step (exit 75), with nothing written."""
    torch.manual_seed(config.run.seed)
    session = None
    with StopSignal() as stop:
        watch = CallWatch(config.orchestration, stop, run_dir_of(config))  # the run's one watch
        report_start(config)
        try:
            with stop.guarded():
                session = Session.start(
                    config, watch, resume, lambda: print(start_line(config), flush=True)
                )
            if stop.received:
                return stopped(stop_message(session, stop, saved=False))
            record_facts(session)
            watch.announce()
            return run_with_faults(session, stop)
        except (AcceptanceError, SamplerExhausted) as err:  # a requeue would meet them again
            newest = checkpoints.list_checkpoints(session.run_dir) if session else []
            print(exit_message(err, newest[-1] if newest else None), file=sys.stderr, flush=True)
            return EXIT_ACCEPTANCE
        finally:
            report_phase("close")
            if session is not None:
                session.close()
            else:
                shutdown_ray(config.orchestration.shutdown_timeout_s)
            report_phase(UNWATCHED)  # what follows the run is not watched
