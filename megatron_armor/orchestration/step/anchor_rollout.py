"""Phase 1 of a step — anchor rollout with rejection sampling (docs/algorithm.md, anchor rollout, Algorithm 1 l. 3-19).

Per generation batch: ``n_on`` policy samples per query, scored; then, for ``armor`` /
``filter_only``, ``algo.ref_n`` reference samples (same sampling settings) only for the
queries whose on-policy group passes rule (a) — the others are rejected whatever the
reference does, so sampling it for them would be wasted — scored too (with the anchor cache,
only the fresh ones: a cached anchor keeps the reward it got when drawn). With the anchor
cache, a query whose cached reference samples of this period are scored and all wrong is
rejected by rule (b) before anything is drawn for it (``anchor/rejected_cached_no_ref_correct``);
:func:`~megatron_armor.algo.anchors.select_group` accepts or rejects each query. Batches
are drawn until ``rollout.batch`` (``B``) groups are accepted, the first ``B`` are kept, and
after ``algo.max_gen_batches`` batches without enough groups the step is short: it trains on
the groups it has when they reach the floor of ``algo.on_short_batch: train_partial``, else
it fails with the acceptance statistics and the settings that would help (``acceptance.py``).

With ``rollout.reference_first`` the order is turned around: the reference samples of every
query first, scored; rule (b) rejects the queries without a correct one (their policy samples
would be drawn for nothing, whatever rule (a) says), and only the others get policy samples.
Fewer samples whenever rule (b) rejects more than ``ref_n / n_on`` times as many queries as
rule (a) does (docs/algorithm.md); the accepted groups are selected by the same rules.
``rollout.reference_first: auto`` (the default) picks the order of each step by that rule from
the rejection shares of the step before (:func:`prefers_reference_first`): the previous step's
metrics, which a checkpoint carries, so a resumed run picks the same order.

The first batch of a step has ``rollout.gen_batch`` queries; each follow-up batch is sized to
the shortfall (:func:`followup_size`: the missing groups over the acceptance rate seen so far
this step, at least :data:`FOLLOWUP_FLOOR` of ``gen_batch``, at most ``gen_batch``).

Scoring overlaps reference generation: a generation batch is cut into
``rollout.reference_parts`` contiguous parts (:func:`reference_parts`); each part's policy
samples are scored and its reference samples drawn and scored as soon as they are, while the
other parts are still being scored (one driver thread per part waiting on the actors).

Sampling seeds are ``derive_seed(run.seed, step, batch, role)`` (role ``policy``, or
:func:`reference_role` of the part), the parts are a function of the batch alone and the
results are merged in part order, and batch sizes depend only on the samples drawn: so
regenerating a step after a resume draws exactly the same samples, whatever order the parts
finished in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megatron_armor.algo.anchors import AcceptanceStats, acceptance_reason, select_group
from megatron_armor.algo.registry import get_anchor_mode
from megatron_armor.config.validate import short_batch_floor
from megatron_armor.data.retirement import retire_drawn
from megatron_armor.observability.timers import PhaseTimers
from megatron_armor.orchestration.actors.actor_handles import merge_reward_stats
from megatron_armor.orchestration.actors.workers import shard
from megatron_armor.orchestration.step.acceptance import check_short
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.types import Group, Sample

log = logging.getLogger(__name__)

MAX_PART_THREADS = 16
"""Reference parts of a generation batch in flight at once (driver threads waiting on Ray)."""
FOLLOWUP_FLOOR = 0.25
"""Smallest follow-up generation batch, as a fraction of ``rollout.gen_batch`` (a tiny batch
would pay a whole round of engine latency for a few queries)."""


def derive_seed(seed: int, step: int, batch: int, role: str) -> int:
    """A 31-bit sampling seed that depends only on ``(seed, step, batch, role)``."""
    digest = hashlib.blake2b(f"{seed}/{step}/{batch}/{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class RolloutResult:
    """The accepted groups of one step and what it took to get them."""

    groups: list[Group]
    stats: AcceptanceStats
    records: list[dict[str, Any]] = field(default_factory=list)
    policy_samples: list[Sample] = field(default_factory=list)
    reward_stats: dict[str, float] = field(default_factory=dict)
    generated_tokens: int = 0
    """Response tokens generated this step (policy + reference, fresh or cached)."""
    prompt_tokens: int = 0
    """Prompt tokens of those samples (each sample's prompt counted once)."""
    policy_sequences: int = 0
    reference_sequences: int = 0
    """Samples drawn this step, by source (as ``generated_tokens`` counts them)."""
    policy_decode_steps: int = 0
    reference_decode_steps: int = 0
    """The longest response of each generation batch's policy (reference) samples, summed:
    the decode iterations the engines ran for them at least (``planner/phase_time.py``)."""
    reference_first: bool = False
    """Whether this step drew the reference samples first (``rollout.reference_first``)."""
    reference_prefetched: bool = False
    """Whether its first batch's reference samples were drawn during the step before
    (:meth:`AnchorRollout.prefetch`)."""
    short_batch: bool = False
    """Whether the step trains on fewer than ``rollout.batch`` groups (``acceptance.py``)."""


def followup_size(gen_batch: int, need: int, accepted: int, seen: int) -> int:
    """Queries in the next generation batch of a step: ``ceil((need - accepted) / rate)`` with
    ``rate = accepted / seen`` this step, clamped to ``[ceil(FOLLOWUP_FLOOR * gen_batch),
    gen_batch]``; the first batch (``seen == 0``) and a step with nothing accepted yet get a
    whole ``gen_batch``. Deterministic in its arguments (exact resume)."""
    if seen == 0 or accepted == 0:
        return gen_batch
    floor = max(1, math.ceil(FOLLOWUP_FLOOR * gen_batch))
    wanted = math.ceil((need - accepted) * seen / accepted)
    return max(floor, min(gen_batch, wanted))


def count_drawn(
    result: RolloutResult, policy: list[list[Sample]], reference: list[list[Sample]]
) -> None:
    """Add a generation batch's samples (``policy`` and ``reference`` rows) to ``result``'s
    counts: response and prompt tokens, samples by source and their decode iterations."""
    drawn = [s for row in policy for s in row], [s for row in reference for s in row]
    for samples in drawn:
        result.generated_tokens += sum(s.response_len for s in samples)
        result.prompt_tokens += sum(len(s.prompt_ids) for s in samples)
    result.policy_sequences += len(drawn[0])
    result.reference_sequences += len(drawn[1])
    result.policy_decode_steps += max((s.response_len for s in drawn[0]), default=0)
    result.reference_decode_steps += max((s.response_len for s in drawn[1]), default=0)


def reference_role(part: int) -> str:
    """The seed role of a generation batch's reference part (part 0 keeps the plain
    ``reference`` role of a batch sampled in one part)."""
    return "reference" if part == 0 else f"reference/{part}"


def reference_parts(query_ids: list[str], parts: int) -> list[list[int]]:
    """Item indices of each reference part of a generation batch: ``parts`` contiguous,
    nearly equal slices (fewer when there are fewer items). A function of the batch alone, so
    which items share a reference call and its seed does not depend on which part's scoring
    finished first (exact resume). A query id drawn twice must not be looked up in the anchor
    cache by two concurrent parts: such a batch is one part."""
    slices = shard(list(range(len(query_ids))), max(1, min(parts, len(query_ids))))
    owner: dict[str, int] = {}
    for p, ids in enumerate(slices):
        for i in ids:
            if owner.setdefault(query_ids[i], p) != p:
                return [list(range(len(query_ids)))]
    return slices


def driver_swaps(config) -> bool:
    """Whether the driver swaps the reference weights into the SGLang policy servers around
    each reference call (``ref_strategy: swap`` without a reference pool,
    ``orchestration/actors/weight_sync.py``)."""
    from megatron_armor.config.rollout_traits import reference_strategy
    from megatron_armor.config.sglang_pools import uses_ref_pool
    from megatron_armor.rollout.backends import backend_of

    served = reference_strategy(config.rollout.ref_strategy, config.algo.anchor_source)
    swaps = backend_of(config).serves_over_http and served.swaps_into_policy
    return swaps and not uses_ref_pool(config)


def overlap_parts(config) -> int:
    """``rollout.reference_parts``, or 1 where the driver swaps the reference weights into the
    policy servers (:func:`driver_swaps`): concurrent calls would interleave the swaps."""
    return 1 if driver_swaps(config) else config.rollout.reference_parts


def prefetches_reference(config) -> bool:
    """``rollout.prefetch_reference`` where it applies: an order that can draw the reference
    first (rule (b): ``armor`` / ``filter_only``; ``reference_first`` not ``false``; one
    reference part), fresh anchors (the anchor cache decides per query what it generates),
    engines that keep serving while the trainer works (not ``colocated``) and a reference
    call the driver need not wrap in a weight swap (:func:`driver_swaps`)."""
    return bool(
        config.rollout.prefetch_reference
        and get_anchor_mode(config.algo.anchor).needs_reference_correct
        and config.resolved.reference_first is not False
        and config.rollout.reference_parts == 1
        and not caches_anchors(config)
        and config.orchestration.layout != "colocated"
        and not driver_swaps(config)
    )


def caches_anchors(config) -> bool:
    """Whether reference samples come through the anchor cache (``algo.anchor_source: cache``
    or ``rollout.ref_strategy: cache``) in a run that draws them."""
    from megatron_armor.config.rollout_traits import reference_strategy

    strategy, _ = reference_strategy(config.rollout.ref_strategy, config.algo.anchor_source)
    return strategy == "cache" and get_anchor_mode(config.algo.anchor).draws_reference


def passes_rule_a(policy: list[Sample], mode: str, weak_filter: bool) -> bool:
    """Whether a query's on-policy group passes rule (a), so its acceptance depends on the
    reference (rule (b)): with no reference samples, exactly those queries are rejected for
    ``no_reference_correct``."""
    reason = acceptance_reason(policy, [], get_anchor_mode(mode), weak_filter)
    return reason == "no_reference_correct"


def prefers_reference_first(previous: dict[str, Any], n_on: int, ref_n: int) -> bool:
    """``rollout.reference_first: auto``: whether the step after one with metrics ``previous``
    draws the reference samples first (docs/algorithm.md, the cost rule).

    Per query that has no cached verdict, policy first draws ``n_on + m ref_n (1 - p_a)``
    samples and reference first ``m ref_n + n_on (1 - q)``, with ``p_a`` the share rule (a)
    rejects, ``q`` the share rule (b) rejects and ``m`` the share of reference look-ups that
    generate (the anchor cache's misses; 1 without the cache or after a reset, which empties
    it): reference first is cheaper iff ``n_on q > m ref_n p_a``. The shares are those of the
    previous step: each rule's rejections over the queries it judged (rule (b) judges only
    the queries that passed rule (a) in the policy-first order, rule (a) only those that
    passed rule (b) in the other). Policy first when the previous step judged nothing (the
    first step, or a checkpoint line without ``anchor/*``)."""
    keys = ("anchor/queries_seen", "anchor/rejected_all_correct", "anchor/rejected_all_wrong",
            "anchor/rejected_no_ref_correct")  # fmt: skip
    if any(previous.get(k) is None for k in keys):
        return False
    cached = previous.get("anchor/rejected_cached_no_ref_correct") or 0.0
    live = previous["anchor/queries_seen"] - cached
    rule_a = previous["anchor/rejected_all_correct"] + previous["anchor/rejected_all_wrong"]
    rule_b = previous["anchor/rejected_no_ref_correct"] - cached
    if previous.get("anchor/reference_first"):
        judged_a, judged_b = live - rule_b, live
    else:
        judged_a, judged_b = live, live - rule_a
    if judged_a <= 0 or judged_b <= 0:
        return False
    misses = previous.get("anchor/cache_misses") or 0.0
    lookups = misses + (previous.get("anchor/cache_hits") or 0.0)
    generated = misses / lookups if lookups else 1.0
    if previous.get("reset/performed"):  # the reset emptied the anchor cache: all will miss
        generated = 1.0
    return n_on * (rule_b / judged_b) > generated * ref_n * (rule_a / judged_a)


def _record(
    item, gen_batch: int, reason: str, policy: list[Sample], reference: list[Sample]
) -> dict:
    return {
        "query_id": item.query_id, "gen_batch": gen_batch, "reason": reason,
        "policy_correct": sum(bool(s.acc) for s in policy), "policy_n": len(policy),
        "ref_correct": sum(bool(s.acc) for s in reference), "ref_n": len(reference),
        "policy_lengths": [s.response_len for s in policy],
    }  # fmt: skip


class AnchorRollout:
    """Collect ``B`` accepted groups for one step (the ``generate -> score -> accept`` verbs)."""

    def __init__(
        self, config, dataset, sampler, policy, reference, reward_group, progress=None, timers=None
    ):
        """``policy`` and ``reference``: where the samples come from (``rollout_draws``:
        ``PolicyDraws``, ``ReferenceDraws``); ``reward_group``: the scorers (``RewardActors``)."""
        self.timers = timers or PhaseTimers()
        self.algo, self.rollout_cfg, self.seed = config.algo, config.rollout, config.run.seed
        self.mode = get_anchor_mode(config.algo.anchor)
        self.dataset, self.sampler = dataset, sampler
        self.policy, self.reference, self.reward = policy, reference, reward_group
        self.progress = progress
        self.parts = overlap_parts(config)
        self.caches_anchors = caches_anchors(config)
        order = config.resolved.reference_first  # None: each step by the cost rule
        self.reference_first = order if self.mode.needs_reference_correct else False
        if self.parts != 1 and order is None:  # the parts overlap the policy-first order
            self.reference_first = False
        self.previous: dict[str, Any] = {}
        self.config, self.floor, self._warned_short = config, short_batch_floor(config), False
        self.prefetches = prefetches_reference(config)
        self._prefetched: tuple | None = None
        s = config.rollout.sampling
        self.params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                     max_new_tokens=s.max_new_tokens)  # fmt: skip

    def _params(self, step: int, batch: int, role: str) -> SamplingParams:
        return dataclasses.replace(self.params, seed=derive_seed(self.seed, step, batch, role))

    def _draw_policy(self, items: list, step: int, batch: int) -> list[list[Sample]]:
        """The ``n_on`` policy samples of each of ``items`` (seed role ``policy``), unscored."""
        with self.timers.phase("generate", "rollout/policy"):
            return self.policy.generate(items, self._n_on(), self._params(step, batch, "policy"))

    def _n_on(self) -> int:
        return self.mode.policy_samples(self.algo.group_size, self.algo.filter_policy_samples)

    def _draw_scored(self, draws, role: str, items: list, n: int, params: SamplingParams):
        """``draws``' samples (``self.policy`` or ``self.reference``) with the scoring chained
        to it (their ``submit_scored``): ``(rows, reward stats)``; ``role`` names the range in
        the profile. The time until the rows are in is ``generate``, the wait for their scores
        after that ``score``."""
        with self.timers.phase("generate", role):
            call = draws.submit_scored(items, n, params, self.reward)
            rows = call.rows()
        with self.timers.phase("score"):
            return rows, call.score()

    def _draw_policy_scored(self, items: list, step: int, batch: int):
        """:meth:`_draw_policy`, scored: ``(rows, reward stats)``."""
        return self._draw_scored(self.policy, "rollout/policy", items, self._n_on(),
                                 self._params(step, batch, "policy"))  # fmt: skip

    def _draw_reference(self, items: list, params: SamplingParams):
        """The ``ref_n`` reference samples of each of ``items``, scored: ``(rows, stats)``.
        Scoring is chained to the sampling, except with the anchor cache, whose hits come back
        scored: then only the fresh samples are sent, after the rows are in
        (:meth:`_score_reference`)."""
        if not self.caches_anchors:
            return self._draw_scored(self.reference, "rollout/reference", items,
                                     self.algo.ref_n, params)  # fmt: skip
        with self.timers.phase("generate", "rollout/reference"):
            drawn = self.reference.sample(items, self.algo.ref_n, params)
        return drawn, self._score_reference(items, drawn)

    def _generate(self, items: list, step: int, batch: int) -> tuple[list, list, dict]:
        """Policy samples of ``items``, scored; then, per part of :func:`reference_parts`,
        reference samples, scored, for its items that pass rule (a) (``[]`` for the others).
        With several parts the policy samples are scored part by part and the parts run
        concurrently, so one part's scoring overlaps another's reference generation.
        Returns ``(policy, reference, stats)``."""
        if not self.mode.draws_reference:
            policy, stats = self._draw_policy_scored(items, step, batch)
            return policy, [[] for _ in items], stats
        parts = reference_parts([it.query_id for it in items], self.parts)
        if len(parts) == 1:
            policy, stats = self._draw_policy_scored(items, step, batch)
            drawn, ref_stats = self._reference_of_passing(items, policy, parts[0], step, batch, 0)
            done = [(drawn, merge_reward_stats(stats, ref_stats))]
        else:
            policy = self._draw_policy(items, step, batch)
            jobs = [(items, policy, ids, step, batch, p) for p, ids in enumerate(parts)]
            workers = ThreadPoolExecutor(max_workers=min(len(jobs), MAX_PART_THREADS))
            # the step waits on the parts' reference calls and their scoring together
            with workers as pool, self.timers.step_phase("rollout/reference"):
                done = list(pool.map(lambda job: self._score_then_reference(*job), jobs))
        reference: list[list[Sample]] = [[] for _ in items]
        stats: dict[str, float] = {}
        for drawn, part_stats in done:  # in part order: the same sums whatever finished first
            for i, row in drawn.items():
                reference[i] = row
            stats = merge_reward_stats(stats, part_stats)
        return policy, reference, stats

    def _score_then_reference(
        self, items: list, policy: list, ids: list[int], step: int, batch: int, part: int
    ) -> tuple[dict[int, list[Sample]], dict]:
        """One part of several: score its policy samples, then
        :meth:`_reference_of_passing`. Returns ``({item index: reference row}, stats)``."""
        with self.timers.phase("score"):
            stats = self.reward.score([s for i in ids for s in policy[i]])
        drawn, ref_stats = self._reference_of_passing(items, policy, ids, step, batch, part)
        return drawn, merge_reward_stats(stats, ref_stats)

    def _reference_of_passing(
        self, items: list, policy: list, ids: list[int], step: int, batch: int, part: int
    ) -> tuple[dict[int, list[Sample]], dict]:
        """Reference samples (seed of ``part``), scored, for the items of ``ids`` whose scored
        policy samples pass rule (a): ``({item index: reference row}, stats)``."""
        wanted = [
            i for i in ids if passes_rule_a(policy[i], self.algo.anchor, self.algo.weak_filter)
        ]
        if not wanted:
            return {}, {}
        params = self._params(step, batch, reference_role(part))
        drawn, stats = self._draw_reference([items[i] for i in wanted], params)
        return dict(zip(wanted, drawn, strict=True)), stats

    def _score_reference(self, items: list, drawn: list[list[Sample]]) -> dict:
        """Score the reference samples not already ``scored`` (cached anchors keep the reward
        they were given when drawn); with the anchor cache, the workers then remember the
        scores of every row of the call (hits again, unchanged: the rows go to the workers
        sharded exactly as the ``sample_reference`` call that drew them)."""
        unscored = [s for row in drawn for s in row if not s.scored]
        if not unscored:
            return {}
        with self.timers.phase("score"):
            stats = self.reward.score(unscored)
        if self.caches_anchors:
            self.reference.remember_scores(items, drawn)
        return stats

    def _reference_first(self, items: list, verdicts: list, step: int, batch: int, ready=None):
        """``rollout.reference_first``: reference samples of the items without a verdict
        (``verdicts[i] is None``), scored; an item none of whose samples is correct gets them
        as its verdict (rejected by rule (b)); then policy samples, scored, for the others.
        ``ready``: the ``(rows, stats)`` of the reference call, drawn already by
        :meth:`prefetch`. Returns ``(policy, reference, stats)`` of the items still without a
        verdict, in order."""
        live = [i for i, v in enumerate(verdicts) if v is None]
        params = self._params(step, batch, reference_role(0))
        drawn, stats = ready or self._draw_reference([items[i] for i in live], params)
        reference = []
        for i, row in zip(live, drawn, strict=True):
            if any(s.acc for s in row):
                reference.append(row)
            else:
                verdicts[i] = row
        solved = [items[i] for i, v in enumerate(verdicts) if v is None]
        if not solved:
            return [], [], stats
        policy, policy_stats = self._draw_policy_scored(solved, step, batch)
        return policy, reference, merge_reward_stats(stats, policy_stats)

    def _cached_verdicts(self, items: list) -> list[bool]:
        """Per item, whether rule (b) already rejects it: the anchor cache holds its ``ref_n``
        scored reference samples of this reference period and none is correct. Its on-policy
        samples would be drawn for nothing, so they are not (all ``False`` without the cache)."""
        if not (self.caches_anchors and self.mode.needs_reference_correct):
            return [False] * len(items)
        return self.reference.unsolved(items, self.algo.ref_n)

    def _accept(
        self, items, verdicts, policy, reference, gen_batch: int, result: RolloutResult
    ) -> None:
        """Accept or reject ``items``. ``verdicts[i]``: ``None``, item ``i`` is decided by its
        rows in ``policy`` / ``reference`` (those hold the rows of such items, in order); else
        it is rejected by rule (b) before its policy samples were drawn: ``[]`` by the anchor
        cache's verdict, or its reference samples, none correct (``rollout.reference_first``)."""
        drawn = iter(zip(policy, reference, strict=True))
        for item, verdict in zip(items, verdicts, strict=True):
            if verdict is not None:
                cached = not verdict
                result.stats.record("no_reference_correct", verdict, None, item.query_id, cached)
                record = _record(item, gen_batch, "no_reference_correct", [], verdict)
                result.records.append({**record, "cached_verdict": True} if cached else record)
                continue
            pol, ref = next(drawn)
            group, reason = select_group(
                item.query_id, pol, ref, self.algo.anchor, self.algo.weak_filter
            )
            anchor = (
                group.samples[group.anchor_index]
                if group and group.anchor_index is not None
                else None
            )
            result.stats.record(reason, ref, anchor, query_id=item.query_id)
            record = _record(item, gen_batch, reason, pol, ref)
            if group is not None:
                record["kept"] = len(result.groups) < self.rollout_cfg.batch
                if record["kept"]:
                    result.groups.append(group)
            result.records.append(record)

    def observe(self, metrics: dict[str, Any]) -> None:
        """Keep a finished step's metrics (or, on resume, the checkpoint's line): with
        ``rollout.reference_first: auto`` the next step's order follows from them."""
        self.previous = dict(metrics)

    def step_reference_first(self) -> bool:
        """Whether the next step draws the reference samples first."""
        if self.reference_first is not None:
            return self.reference_first
        return prefers_reference_first(self.previous, self._n_on(), self.algo.ref_n)

    def prefetch(self, step: int, result: RolloutResult) -> bool:
        """Send the first reference call of step ``step + 1`` now, while the trainer works on
        step ``step`` (``result``), when that step will draw the reference first
        (``rollout.prefetch_reference``, :func:`prefetches_reference`). The call is the one
        :meth:`collect` would make: the same queries (the sampler's next ``rollout.gen_batch``,
        read without advancing it), the same seed (``derive_seed(run.seed, step + 1, 0,
        "reference")``) and the same reference weights — the caller sends it only when no
        reference reset comes between — so it draws the same samples, and a resumed run,
        which draws them itself, stays exact. :meth:`collect` of step ``step + 1`` takes it
        when its first batch is that call (``perf/reference_prefetched``); otherwise it is
        left unused. Returns whether it was sent."""
        self._prefetched = None
        if not self.prefetches:
            return False
        if self.reference_first is None:
            upcoming = {**result.stats.as_metrics(),
                        "anchor/reference_first": float(result.reference_first)}  # fmt: skip
            if not prefers_reference_first(upcoming, self._n_on(), self.algo.ref_n):
                return False
        size = followup_size(self.rollout_cfg.gen_batch, self.rollout_cfg.batch, 0, 0)
        items = [self.dataset[i] for i in self.sampler.peek(size)]
        params = self._params(step + 1, 0, reference_role(0))
        call = self.reference.submit_scored(items, self.algo.ref_n, params, self.reward,
                                            wait_rows=False)  # fmt: skip
        self._prefetched = (step + 1, items, call)
        return True

    def forget_prefetch(self) -> None:
        """Drop the call :meth:`prefetch` sent (a worker died since:
        ``orchestration/actors/recovery.py``); the step draws it itself, with the same seed."""
        self._prefetched = None

    def _prefetched_rows(self, pending: tuple | None, step: int, items: list):
        """The ``(rows, stats)`` of :meth:`prefetch`'s call ``pending`` when it is the
        reference call of this step's first batch (same step, same queries: without the
        anchor cache every query of the batch is live), else ``None`` (it is left unused)."""
        if pending is None or pending[:2] != (step, items):
            return None
        call = pending[2]
        try:
            with self.timers.phase("generate", "rollout/reference"):
                rows = call.rows()
            with self.timers.phase("score"):
                return rows, call.score()
        except Exception as err:  # e.g. a server died since: draw it again, same seed
            log.warning("step %d: the reference call sent during the step before failed (%s); "
                        "drawing it again", step, err)  # fmt: skip
            return None

    def collect(self, step: int) -> RolloutResult:
        """Draw generation batches until ``rollout.batch`` groups are accepted; keep the first ``B``."""
        need = self.rollout_cfg.batch
        result = RolloutResult(groups=[], stats=AcceptanceStats())
        result.reference_first = self.step_reference_first()
        pending, self._prefetched = self._prefetched, None
        for gen_batch in range(self.algo.max_gen_batches):
            size = followup_size(self.rollout_cfg.gen_batch, need, result.stats.accepted,
                                 result.stats.queries_seen)  # fmt: skip
            indices = self.sampler.next_indices(size)
            items = [self.dataset[i] for i in indices]
            verdicts = [[] if known else None for known in self._cached_verdicts(items)]
            live = [item for item, v in zip(items, verdicts, strict=True) if v is None]
            if not live:
                policy, reference, stats = [], [], {}
            elif result.reference_first:
                ready = self._prefetched_rows(pending, step, items) if gen_batch == 0 else None
                result.reference_prefetched |= ready is not None
                policy, reference, stats = self._reference_first(items, verdicts, step,
                                                                 gen_batch, ready)  # fmt: skip
            else:
                policy, reference, stats = self._generate(live, step, gen_batch)
            result.reward_stats = merge_reward_stats(result.reward_stats, stats)
            result.stats.add_generation_batch()
            result.policy_samples.extend(s for row in policy for s in row)
            count_drawn(result, policy, [*reference, *(v for v in verdicts if v)])
            first = len(result.records)
            self._accept(items, verdicts, policy, reference, gen_batch, result)
            retire_drawn(self.sampler, indices, result.records[first:])
            if self.progress is not None:
                self.progress(min(len(result.groups), need), need, result.stats)
            if len(result.groups) >= need:
                return result
        result.short_batch = True  # or the AcceptanceError, below the floor
        check_short(step, result.stats, len(result.groups), self.floor, self.config,
                    warn=not self._warned_short, previous=self.previous)  # fmt: skip
        self._warned_short = True  # later short steps: "SHORT batch of k" in their step line
        return result
