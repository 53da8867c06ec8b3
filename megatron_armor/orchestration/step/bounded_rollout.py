"""Bounded staleness with partial rollouts: generation never waits for its slowest sample.

``orchestration.async_rollout: bounded`` (docs/orchestration.md, "Bounded staleness"; the
objective: docs/algorithm.md). Generation runs in *windows*, one per weight version, each in
rounds of one engine call in which every response in flight decodes at most ``W =
ceil(max_new_tokens / k)`` tokens (``algo.staleness.window_tokens``, ``k =
orchestration.max_staleness``), until a step's groups wait (:meth:`WindowRollout.collect`); a
response that has not ended then is carried to the next window and goes on under the weights
pushed since, from the tokens it has (``partial_rollout.py``). The window of step t+1 runs on a
driver thread while the trainer works on step t, as ``one_step``'s rollout does::

    step t    trainer:  take B waiting groups (stalest first, <= k versions old) -> logprobs
                        (``old`` = the live weights: the proximal policy) -> updates -> export
              engines:  window t+1 on the weights of step t-1: rounds of the responses in
                        flight and new generation batches until B groups wait ......|
              then:     push(t) -> reset? (drops the waiting groups) -> validate? -> checkpoint
                        (holds the window, the waiting groups and the responses in flight)

A query is judged once its last response has ended: its responses scored, rule (a), its
reference samples drawn from the current reference and scored, rule (b) (``select_group``);
an accepted group waits for a step. A step that resets the reference does not overlap (the
next window is drawn after the reset, from the new reference), and the groups waiting then
are dropped: their anchors and rule (b) came from the old reference. Responses in flight go
on across a reset (they are the policy's). The last step draws no window.

Every decision depends on the samples alone (seeds ``derive_seed(run.seed, step, round,
role)``, a window's rounds numbered in order), so a checkpoint of the window's state
(:meth:`BoundedPipeline.in_flight`) resumes exactly.
"""

from __future__ import annotations

import itertools
import math
import time

from megatron_armor.algo.anchors import AcceptanceStats, select_group
from megatron_armor.algo.staleness import staleness_metrics, window_tokens
from megatron_armor.data.dataset import PromptItem
from megatron_armor.data.retirement import retire_drawn
from megatron_armor.observability.timers import PhaseTimers
from megatron_armor.orchestration.actors.actor_handles import merge_reward_stats
from megatron_armor.orchestration.step import phases
from megatron_armor.orchestration.step.acceptance import check_short
from megatron_armor.orchestration.step.anchor_rollout import (
    AnchorRollout,
    RolloutResult,
    _record,
    followup_size,
)
from megatron_armor.orchestration.step.async_rollout import (
    Collected,
    Collector,
    collected_from_state,
    collected_state,
    finish_train,
)
from megatron_armor.orchestration.step.partial_rollout import (
    InFlight,
    PartialRollouts,
    extend_sample,
    new_sample,
    tail_idle_seconds,
)
from megatron_armor.orchestration.step.step_metrics import rollout_metrics, write_anchor_file
from megatron_armor.rollout.backends import backend_of
from megatron_armor.rollout.protocol import PartialRequest
from megatron_armor.types import Group, Sample, SampleSource


class WindowRollout(AnchorRollout):
    """The anchor rollout of bounded staleness: :meth:`collect` draws one window from the
    partial rollouts of :attr:`start` (the recovery guard, ``actors/recovery.py``, calls it
    again after a worker is replaced, and each call starts from the same state: the window's
    start), leaving the state after it in :attr:`drawn`."""

    def __init__(self, config, dataset, sampler, policy, reference, reward, timers,
                 session, window: int, start: PartialRollouts) -> None:  # fmt: skip
        """``session``: the run's (its tokenizer, the policy version the engines serve);
        ``window``: the tokens a response decodes per round; ``start``: what is in flight
        (a resumed checkpoint's, or nothing)."""
        super().__init__(config, dataset, sampler, policy, reference, reward, None, timers)
        self.s, self.window, self.start = session, window, start
        self.drawn: PartialRollouts | None = None
        self.counters: dict[str, float] = {}

    def keep_drawn(self) -> dict[str, float]:
        """The state after the window drawn last becomes the next one's start; that window's
        ``async/partial_carried``, ``async/continued_tokens`` and
        ``perf/rollout_tail_idle_s``."""
        self.start = self.drawn
        return {"async/partial_carried": float(len(self.start.requests())),
                "async/continued_tokens": self.counters["continued"],
                "perf/rollout_tail_idle_s": self.counters["tail"]}  # fmt: skip

    def collect(self, step: int) -> RolloutResult:
        """The window of step ``step``: :attr:`drawn` is the state after it; the result holds
        the queries it judged (``groups``: none; the step takes its own).

        The window runs in rounds on one weight version. Each round is one engine call: every
        response in flight decodes up to the window's tokens, beside a new generation batch
        when the groups waiting and the queries in flight or ended (at the acceptance rate seen
        so far) fall short of ``rollout.batch`` (at most ``algo.max_gen_batches`` of them). The
        queries whose responses have all ended are judged together (one scoring call, one
        reference call) once they could fill the batch, all accepted, or nothing is left to
        decode. The first
        round always runs (it continues the responses carried in: none waits a window without
        tokens); the window ends once ``rollout.batch`` groups wait, or when nothing is in
        flight or left to judge and no batch may be drawn."""
        work = PartialRollouts.from_state(self.start.state())
        result = RolloutResult(groups=[], stats=AcceptanceStats())
        carried = {id(sample) for sample, _ in work.requests()}
        self.counters = {"continued": 0.0, "tail": 0.0}
        need, ended = self.s.config.rollout.batch, []
        for round_ in itertools.count():
            if self._wants_batch(work, ended, result.stats, need):
                size = self._batch_size(work, ended, result.stats, need)
                self._draw_batch(step, work, result, size)
            pairs = work.requests()
            if pairs:
                params = self._params(step, round_, "policy")
                tokens = self._advance(pairs, params, result)
                self.counters["continued"] += sum(n for (s, _), n in zip(pairs, tokens, strict=True)
                                                  if id(s) in carried)  # fmt: skip
                ended += work.pop_ended()
            going = bool(work.requests())
            if ended and (not going or len(work.ready) + len(ended) >= need):
                self._judge(step, round_, ended, work, result)
                ended = []
            if len(work.ready) >= need or not (going or ended or self._batches_left(result.stats)):
                break
        result.short_batch = len(work.ready) < need
        self.drawn = work
        return result

    def _batches_left(self, stats: AcceptanceStats) -> bool:
        return stats.gen_batches < self.algo.max_gen_batches

    def _expected(self, work: PartialRollouts, ended: list, stats: AcceptanceStats) -> float:
        """The groups waiting, plus the queries in flight or ended unjudged at the window's
        acceptance rate so far, ``(accepted + 1) / (judged + 2)`` (never 0: a window that has
        accepted nothing yet does not take its queries in flight for none)."""
        rate = (stats.accepted + 1) / (stats.queries_seen + 2)
        return len(work.ready) + rate * (len(work.in_flight) + len(ended))

    def _wants_batch(self, work, ended: list, stats: AcceptanceStats, need: int) -> bool:
        """Whether this round draws a new generation batch: batches left, and the groups
        expected (:meth:`_expected`) short of ``need``."""
        return self._batches_left(stats) and self._expected(work, ended, stats) < need

    def _batch_size(self, work, ended: list, stats: AcceptanceStats, need: int) -> int:
        """``followup_size`` of the groups still missing once those expected are counted."""
        missing = math.ceil(need - self._expected(work, ended, stats))
        return followup_size(self.rollout_cfg.gen_batch, missing + stats.accepted,
                             stats.accepted, stats.queries_seen)  # fmt: skip

    def _draw_batch(self, step: int, work: PartialRollouts, result, size: int) -> None:
        """``size`` new queries from the sampler, each with its ``n_on`` empty responses."""
        version = self.s.state.policy_version
        indices = self.sampler.next_indices(size)
        batch = result.stats.gen_batches
        work.in_flight += [self._start_query(i, batch, step, version) for i in indices]
        result.stats.add_generation_batch()

    def check_short(self, step: int, result: RolloutResult) -> None:
        """A step with fewer than ``rollout.batch`` groups: trained on them above the floor
        (the run's first says so), else the ``AcceptanceError`` (``acceptance.py``)."""
        check_short(step, result.stats, len(result.groups), self.floor, self.config,
                    warn=not self._warned_short, previous=self.previous)  # fmt: skip
        self._warned_short = True

    def _start_query(self, index: int, gen_batch: int, step: int, version: int) -> InFlight:
        item = self.dataset[index]
        samples = [new_sample(item, version) for _ in range(self._n_on())]
        fields = {k: getattr(item, k) for k in PromptItem.__dataclass_fields__}
        return InFlight(item=fields, gen_batch=gen_batch, started=step, index=index,
                        samples=samples)  # fmt: skip

    def _advance(self, pairs: list[tuple[Sample, PartialRequest]], params, result) -> list[int]:
        """One engine call of the window on the requests of ``pairs``; each output appended to
        its sample; the tokens each drew."""
        with self.timers.phase("generate"):
            requests = [r for _, r in pairs]
            outputs = self.policy.generate_window(requests, params, self.window)
        tokens = [extend_sample(s, o) for (s, _), o in zip(pairs, outputs, strict=True)]
        self.counters["tail"] += tail_idle_seconds([o.seconds for o in outputs])
        result.generated_tokens += sum(tokens)
        return tokens

    def _judge(self, step: int, round_: int, ended: list[InFlight], work, result) -> None:
        """Score the ended queries' responses, draw the reference samples of those that pass
        rule (a) (seed of ``round_``), select: accepted groups wait (``work.ready``)."""
        if not ended:
            return
        policy = [q.samples for q in ended]
        for sample in (x for row in policy for x in row):
            sample.response_text = self.s.tokenizer.decode(sample.response_ids,
                                                           skip_special_tokens=True)  # fmt: skip
        with self.timers.phase("score"):
            stats = self.reward.score([x for row in policy for x in row])
        items = [PromptItem(**q.item) for q in ended]
        drawn, ref_stats = {}, {}
        if self.mode.draws_reference:
            drawn, ref_stats = self._reference_of_passing(items, policy, list(range(len(items))),
                                                          step, round_, 0)  # fmt: skip
        result.reward_stats = merge_reward_stats(result.reward_stats,
                                                 merge_reward_stats(stats, ref_stats))  # fmt: skip
        for i, (query, item) in enumerate(zip(ended, items, strict=True)):
            reference = drawn.get(i, [])
            result.generated_tokens += sum(x.response_len for x in reference)
            self._accept(query, item, reference, work, result)

    def _accept(self, query: InFlight, item, reference: list[Sample], work, result) -> None:
        a = self.algo
        group, reason = select_group(item.query_id, query.samples, reference, a.anchor,
                                     a.weak_filter)  # fmt: skip
        anchor = (
            group.samples[group.anchor_index] if group and group.anchor_index is not None else None
        )
        result.stats.record(reason, reference, anchor, query_id=item.query_id)
        record = {**_record(item, query.gen_batch, reason, query.samples, reference),
                  "kept": False, "started": query.started}  # fmt: skip
        result.records.append(record)
        result.policy_samples.extend(query.samples)
        retire_drawn(self.sampler, [query.index], [record])
        if group is not None:
            work.ready.append(group)


class BoundedPipeline:
    """The loop's step with ``orchestration.async_rollout: bounded`` (module docstring)."""

    def __init__(self, session, rollout: WindowRollout, timers: PhaseTimers, state: dict):
        """``state``: a checkpoint's ``pending`` (``{}``: nothing in flight)."""
        self.s, self.k = session, session.config.orchestration.max_staleness
        self.draw = rollout
        self.collector = Collector(session, self.draw, timers)
        self.pending: Collected | None = collected_from_state(state.get("window", {}))

    @classmethod
    def start(cls, session, timers: PhaseTimers, state: dict) -> BoundedPipeline:
        """The pipeline of ``session``'s run: its window of ``ceil(max_new_tokens / k)``
        tokens with ``orchestration.partial_rollout`` (else ``max_new_tokens``)."""
        cfg, s = session.config, session
        window = cfg.rollout.sampling.max_new_tokens
        if cfg.orchestration.partial_rollout:
            window = window_tokens(window, cfg.orchestration.max_staleness)
        start = PartialRollouts.from_state(state)
        rollout = WindowRollout(cfg, s.dataset, s.sampler, s.rollout.policy, s.rollout.reference,
                                s.reward, timers, s, window, start)  # fmt: skip
        return cls(session, rollout, timers, state)

    def in_flight(self) -> dict:
        """What a checkpoint keeps: the waiting groups and the responses in flight, and the
        window drawn for the next step when there is one; ``{}`` when nothing is in flight."""
        start = self.draw.start
        if not (start.in_flight or start.ready or self.pending):
            return {}
        state = start.state()
        if self.pending is not None:
            state["window"] = collected_state(self.pending)
        return state

    def overlaps(self, step: int) -> bool:
        """Whether the next window is drawn beside this step's updates: not at the last step
        nor at a reset step (the next anchors need the new reference)."""
        return step < self.s.config.run.steps and not self.s.schedule.should_reset(step)

    def _window(self, step: int, version: int) -> Collected:
        collected = self.collector.collect(step, version, "policy")
        return self._with_counters(collected)

    def _with_counters(self, collected: Collected) -> Collected:
        """The window's state kept for the next, its own metrics into ``collected``'s."""
        collected.metrics.update(self.draw.keep_drawn())
        return collected

    def run_step(self, step: int) -> dict[str, float]:
        """One step; leaves the next window in :attr:`pending` when it overlapped."""
        s, t0 = self.s, time.perf_counter()
        window, self.pending, restarted = self.pending, None, 0
        if window is None:  # the first step, a resume after a drained step, or after a drain
            restarted += s.heal_rollout(step)
            window = self._window(step, s.state.policy_version)
        waited = time.perf_counter() - t0
        result = window.result
        result.groups, dropped = self.draw.start.take(s.config.rollout.batch,
                                                      s.state.policy_version, self.k)  # fmt: skip
        self._check_batch(step, result)
        mark_kept(result)
        overlap = self.overlaps(step)
        metrics = dict(phases.NO_UPDATE)
        queued = self._submit(step, result) if result.groups else None
        metrics.update(rollout_metrics(result))
        metrics.update(self._staleness(result.groups, dropped))
        if overlap:
            restarted += s.heal_rollout(step + 1)
            s.recovery.serve(None)  # the engines' weights are kept nowhere meanwhile
            self.collector.launch(step + 1, s.state.policy_version, "policy")
        write_anchor_file(s.run_dir, step, result)
        if queued is not None:
            metrics.update(finish_train(s, step, queued, load_early=not overlap))
        train_end = time.perf_counter()
        if overlap:
            with s.timers.step_phase("rollout/wait"):  # the updates are done: waiting
                self.pending = self._with_counters(self.collector.join())
            s.recovery.serve("policy")
        metrics.update(window.metrics)
        metrics.update(window.timings)
        s.meter.add_rollout(result.generated_tokens, window.timings.get("timing/generate_s", 0.0))
        metrics.update(self._overlap(waited, train_end, overlap))
        restarted += phases.heal_before_push(s, step)
        updated = metrics["train/updates"] > metrics.get("train/skipped_updates", 0.0)
        metrics.update(phases.sync_and_maybe_reset(s, step, updated))
        if metrics["reset/performed"]:
            metrics["async/dropped_at_reset"] = float(self.draw.start.drop_ready())
        metrics["algo/alpha"] = s.config.resolved.alpha
        if backend_of(s.config).serves_over_http:
            restarted += s.recovery.pop_servers_restarted()
            metrics["rollout/servers_restarted"] = float(restarted)
        if phases.validation_due(s.config, step):
            metrics.update(phases.validate(s, step))
        return metrics

    def _check_batch(self, step: int, result: RolloutResult) -> None:
        """Fewer than ``rollout.batch`` groups wait: a short step (``acceptance.py``)."""
        result.short_batch = len(result.groups) < self.s.config.rollout.batch
        if result.short_batch:
            self.draw.check_short(step, result)

    def _submit(self, step: int, result: RolloutResult):
        """The trainer's calls of the step, queued: the log-prob call (``old`` under the live
        weights: the proximal policy), then the updates."""
        s, groups = self.s, result.groups
        packed = phases.prepare_batch(s, groups, step)
        with s.timers.phase("logprobs"):
            logprobs = phases.submit_logprobs(s, packed, step)
        with s.timers.phase("train"):
            updates = phases.submit_minibatches(s, groups)
        return packed, logprobs, updates

    def _staleness(self, groups: list[Group], dropped: int) -> dict[str, float]:
        """``staleness/*`` of the trained policy tokens and the groups dropped for age."""
        versions = [x.token_versions() for g in groups for x in g.samples
                    if x.source == SampleSource.POLICY]  # fmt: skip
        out = staleness_metrics(versions, self.s.state.policy_version, self.k)
        out["async/dropped_stale"] = float(dropped)
        return out

    def _overlap(self, waited: float, train_end: float, overlap: bool) -> dict[str, float]:
        """``async/rollout_wait_s`` (the trainer waiting for windows), ``async/drained``."""
        out = {"async/drained": float(not overlap), "async/rollout_wait_s": waited}
        if overlap:
            out["async/rollout_wait_s"] += time.perf_counter() - train_end
        return out


def holds_next_rollout(pending: dict) -> bool:
    """Whether a checkpoint's ``pending`` holds the next step's rollout (``one_step``'s batch
    or ``bounded``'s window), not only responses in flight."""
    return bool(pending) and ("window" in pending or "partial_rollouts" not in pending)


def mark_kept(result: RolloutResult) -> None:
    """The anchor file's ``kept``: the window's records of the groups this step trains; a
    trained group judged in an earlier window gets a line of its own (``waited``)."""
    taken = {g.query_id for g in result.groups}
    judged = set()
    for record in result.records:
        if record["reason"] == "accepted" and record["query_id"] in taken:
            record["kept"] = True
            judged.add(record["query_id"])
    waited = [g.query_id for g in result.groups if g.query_id not in judged]
    result.records += [{"query_id": q, "reason": "accepted", "kept": True, "waited": True}
                       for q in waited]  # fmt: skip
