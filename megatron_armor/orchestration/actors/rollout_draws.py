"""Samples drawn from the rollout workers: the policy's (:class:`PolicyDraws`) and the
reference's (:class:`ReferenceDraws`), with their scoring chained to the generation
(:func:`submit_scored`), and validation's engine view (:class:`RemoteEngine`).

Prompts are split contiguously over the workers, worker ``i`` seeded ``seed + i``; with the
anchor cache a reference query always goes to the worker that holds its cache entry
(:func:`query_worker`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from megatron_armor.orchestration.actors.actor_handles import assign_scores
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.pending import Pending
from megatron_armor.orchestration.actors.workers import shard
from megatron_armor.rollout.protocol import GenerationOutput, RolloutEngine, SamplingParams
from megatron_armor.types import Sample

if TYPE_CHECKING:
    from megatron_armor.orchestration.actors.actor_handles import RewardActors
    from megatron_armor.orchestration.actors.rollout_fleet import RolloutFleet

ReferenceSwap = Callable[[Callable[[], bool]], AbstractContextManager]
"""``swap(needs_fresh)``: the block in which the reference serves from the policy servers
(``WeightSync.reference_swapped``; ``needs_fresh()`` says whether any item needs fresh
samples, asked only where a swap could happen)."""


def query_worker(query_id: str, workers: int) -> int:
    """The worker (of ``workers``) that serves ``query_id``'s anchor-cache entry: a hash of
    the id that is the same in every process and run (unlike Python's salted ``hash``)."""
    digest = hashlib.blake2b(query_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % workers


def worker_params(params: SamplingParams, worker: int) -> SamplingParams:
    """``params`` for rollout worker ``worker`` of a fanned-out call: seed ``params.seed +
    worker`` (unseeded stays unseeded)."""
    seed = None if params.seed is None else params.seed + worker
    return dataclasses.replace(params, seed=seed)


def contiguous(items: list, workers: int) -> list[list[int]]:
    """The indices of ``items`` each of ``workers`` serves: contiguous, nearly equal parts."""
    return shard(list(range(len(items))), workers)


def in_item_order(served: list[list[int]], size: int) -> Callable[[list], list]:
    """How to read per-worker answers (one row per item of its part ``served[k]``) back into
    ``size`` rows in the items' order."""

    def read(parts: list) -> list:
        out: list = [None] * size
        for part, rows in zip(served, parts, strict=True):
            for j, row in zip(part, rows, strict=True):
                out[j] = row
        return out

    return read


def scatter(fleet: RolloutFleet, actors: list, parts: list[list[int]], items: list,
            call: Callable, kind: CallKind, what: str) -> Pending[list]:  # fmt: skip
    """``call(i, actor, [items of part i])`` on every worker with a non-empty part (the ref of
    one row per item), sent now; the rows come back in ``items`` order."""
    sent = [(i, actor, part) for i, (actor, part) in enumerate(zip(actors, parts, strict=True))
            if part]  # fmt: skip
    refs = [call(i, actor, [items[j] for j in part]) for i, actor, part in sent]
    served = [part for _, _, part in sent]
    return Pending(fleet.watch, refs, kind, what, in_item_order(served, len(items)),
                   work=len(items))  # fmt: skip


class ScoredRows:
    """One generation call with its scoring chained to it (:func:`submit_scored`): each
    rollout worker returns its rows and, as objects of their own, the answers of its samples
    not already ``scored`` in one part per scoring worker; scoring worker ``k`` takes part
    ``k`` of every rollout worker as object refs, so scoring starts as generation ends, with
    no round trip through the driver and each answer sent once. :meth:`rows` waits for the
    samples, :meth:`score` for their rewards (set in place)."""

    def __init__(self, per_worker: Pending[list], served: list[list[int]], size: int,
                 scores: Pending[list]):  # fmt: skip
        """``per_worker``: each worker's rows of its items ``served[k]``, of ``size`` items."""
        self.per_worker, self.served, self.size, self.scores = per_worker, served, size, scores

    def rows(self) -> list[list[Sample]]:
        """``[item][sample]`` in the items' order."""
        return in_item_order(self.served, self.size)(self.per_worker.result())

    def score(self) -> dict[str, float]:
        """Set ``score`` and ``acc`` of the samples that were not ``scored`` (per rollout
        worker, its items' and samples' order, the scoring workers' parts one after another);
        the ``reward/*`` stats."""
        per_worker = self.per_worker.result()
        results = self.scores.result()  # [(scores per rollout worker, stats)]
        samples, scores = [], []
        for w, rows in enumerate(per_worker):
            samples += [s for row in rows for s in row if not s.scored]
            scores += [sa for per_worker, _ in results for sa in per_worker[w]]
        return assign_scores(samples, scores, [stats for _, stats in results])


def submit_scored(fleet: RolloutFleet, actors: list, parts: list[list[int]], method: Callable,
                  items: list, n: int, params: SamplingParams, reward: RewardActors,
                  what: str) -> ScoredRows:  # fmt: skip
    """``method(actor)`` (a generation method of the worker: ``generate``,
    ``sample_reference``) on each worker's part of ``items``, worker ``i`` seeded ``params.seed
    + i``, with ``reward``'s scoring chained to it (:class:`ScoredRows`); sent now."""
    scorers = len(reward.actors)
    row_refs, answer_refs, served = [], [], []
    for i, (actor, part) in enumerate(zip(actors, parts, strict=True)):
        if not part:
            continue
        rows, *answers = method(actor).options(num_returns=1 + scorers).remote(
            [items[j] for j in part], n, worker_params(params, i),
            answers_for=reward.verifier, answer_parts=scorers,
        )  # fmt: skip
        row_refs.append(rows)
        answer_refs.append(answers)
        served.append(part)
    watch, work = fleet.watch, len(items)
    rows = Pending(watch, row_refs, CallKind.GENERATE, what, work=work)
    scores = Pending(watch, reward.submit_score(answer_refs), CallKind.SCORE, "reward scoring",
                     work=work)  # fmt: skip
    return ScoredRows(rows, served, work, scores)


class PolicyDraws:
    """Policy samples from the workers with policy servers (or embedded engines)."""

    def __init__(self, fleet: RolloutFleet) -> None:
        self.fleet = fleet

    def generate(self, items: list, n: int, params: SamplingParams) -> list[list[Sample]]:
        """``n`` policy samples per prompt item, ``[len(items)][n]``, unscored."""
        actors = self.fleet.policy_actors
        call = lambda i, a, part: a.generate.remote(part, n, worker_params(params, i))  # noqa: E731
        return scatter(self.fleet, actors, contiguous(items, len(actors)), items, call,
                       CallKind.GENERATE, "rollout generate").result()  # fmt: skip

    def submit_scored(self, items: list, n: int, params: SamplingParams,
                      reward: RewardActors) -> ScoredRows:  # fmt: skip
        """:meth:`generate` with ``reward``'s scoring chained to it; returns once the rows
        are in (the scoring is under way)."""
        actors = self.fleet.policy_actors
        call = submit_scored(self.fleet, actors, contiguous(items, len(actors)),
                             lambda a: a.generate, items, n, params, reward,
                             "rollout generate")  # fmt: skip
        call.rows()
        return call

    def generate_window(
        self, requests: list, params: SamplingParams, window_tokens: int
    ) -> list[GenerationOutput]:
        """One window of a partial rollout over the policy workers (contiguous parts, worker
        ``i`` seeded ``params.seed + i``): each request's new tokens, in ``requests`` order."""
        actors = self.fleet.policy_actors

        def call(i, a, part):
            return a.generate_window.remote(part, worker_params(params, i), window_tokens)

        return scatter(self.fleet, actors, contiguous(requests, len(actors)), requests, call,
                       CallKind.GENERATE, "rollout generate_window").result()  # fmt: skip

    def generate_raw(self, prompts, n, params, weights="policy") -> list[list[GenerationOutput]]:
        """Engine outputs as they are (validation)."""
        actors = self.fleet.policy_actors

        def call(i, a, part):
            return a.generate_raw.remote(part, n, worker_params(params, i), weights)

        return scatter(self.fleet, actors, contiguous(prompts, len(actors)), prompts, call,
                       CallKind.VALIDATION, "rollout generate_raw").result()  # fmt: skip

    def weight_versions(self) -> list[dict[str, int]]:
        """Per policy worker, ``{pool or weight set: version}`` it serves."""
        return self.fleet.send(
            self.fleet.policy_actors,
            lambda a: a.weight_versions.remote(),
            CallKind.WEIGHT_VERSIONS,
            "rollout weight versions",
        ).result()


class ReferenceDraws:
    """Reference samples and the anchor cache, from the workers that sample the reference.

    The cache's scores are sent without waiting (:meth:`remember_scores`): a Ray actor runs
    one caller's calls in the order sent (these actors are single-threaded and never retry a
    call), so a worker's next cache call sees them; the reads that need them
    (:meth:`metrics`, :meth:`state_dicts`) wait for them first and raise what failed."""

    def __init__(self, fleet: RolloutFleet, caches_anchors: bool, swap: ReferenceSwap,
                 swaps_into_policy_servers: bool) -> None:  # fmt: skip
        """``swap``: the block around a reference call in which the policy servers serve the
        reference, with ``swaps_into_policy_servers`` (both from the weight sync)."""
        self.fleet, self.caches_anchors = fleet, caches_anchors
        self.swap, self.swaps_into_policy_servers = swap, swaps_into_policy_servers
        self.unsettled: list[Pending] = []

    @property
    def actors(self) -> list:
        return self.fleet.reference_actors

    def parts(self, items: list) -> list[list[int]]:
        """The indices of ``items`` each reference worker serves. With the anchor cache a
        query always goes to the worker holding its cache entry (:func:`query_worker` of its
        id), so a recurring query hits whatever batch it comes in; otherwise contiguous."""
        workers = len(self.actors)
        if not self.caches_anchors or workers == 1:
            return contiguous(items, workers)
        parts: list[list[int]] = [[] for _ in range(workers)]
        for j, item in enumerate(items):
            parts[query_worker(item.query_id, workers)].append(j)
        return parts

    def _swapped(self, items: list, n: int):
        return self.swap(lambda: self.misses(items, n) > 0)

    def sample(self, items: list, n: int, params: SamplingParams) -> list[list[Sample]]:
        """``n`` reference samples per prompt item, in generation order (in the block of
        ``swap``)."""

        def call(i, a, part):
            return a.sample_reference.remote(part, n, worker_params(params, i))

        with self._swapped(items, n):
            return scatter(self.fleet, self.actors, self.parts(items), items, call,
                           CallKind.GENERATE, "rollout sample_reference").result()  # fmt: skip

    def submit_scored(self, items: list, n: int, params: SamplingParams, reward: RewardActors,
                      wait_rows: bool = True) -> ScoredRows:  # fmt: skip
        """:meth:`sample` with ``reward``'s scoring chained to it. Returns once the rows are
        in (the scoring is under way), before the policy goes back where it was swapped out;
        ``wait_rows=False`` returns as soon as the calls are sent (an error where the
        reference is swapped into the policy servers: the policy must not go back before the
        rows are in)."""
        if not wait_rows and self.swaps_into_policy_servers:
            raise ValueError("submit_scored: the reference is swapped into the policy "
                             "servers around this call; it must wait for its rows")  # fmt: skip
        with self._swapped(items, n):
            call = submit_scored(self.fleet, self.actors, self.parts(items),
                                 lambda a: a.sample_reference, items, n, params, reward,
                                 "rollout sample_reference")  # fmt: skip
            if wait_rows:
                call.rows()
        return call

    def remember_scores(self, items: list, rows: list[list[Sample]]) -> None:
        """The anchor cache keeps the scores of ``rows``, the reference samples a
        :meth:`sample` call just returned for the same ``items`` (each worker gets the rows of
        its own cache: :meth:`parts`); sent without waiting (class docstring)."""
        refs = [
            actor.remember_reference_scores.remote(
                [items[j].query_id for j in part],
                [[(s.score, s.acc) for s in rows[j]] for j in part],
            )
            for actor, part in zip(self.actors, self.parts(items), strict=True)
            if part
        ]
        self.unsettled.append(self.fleet.pending(refs, CallKind.REFERENCE_SCORES,
                                      "rollout reference scores"))  # fmt: skip

    def settle(self) -> None:
        """Wait for the unwaited calls of :meth:`remember_scores`."""
        unsettled, self.unsettled = self.unsettled, []
        if unsettled:
            refs = [ref for p in unsettled for ref in p.refs]
            self.fleet.pending(refs, CallKind.REFERENCE_SCORES,
                    "rollout reference scores").result()  # fmt: skip

    def forget_unsettled(self) -> None:
        """Drop the unwaited calls of a step that a worker's death cut short (they may hold
        its error; the step is drawn again: ``orchestration/actors/recovery.py``)."""
        self.unsettled = []

    def unsolved(self, items: list, n: int) -> list[bool]:
        """Per item, whether the anchor cache already holds ``n`` scored reference samples of
        it, none correct: rule (b) rejects such a query whatever its on-policy samples are."""
        call = lambda i, actor, part: actor.reference_unsolved.remote(part, n)  # noqa: E731
        flags = scatter(self.fleet, self.actors, self.parts(items), items, call,
                        CallKind.REFERENCE_CACHE, "rollout reference cache").result()  # fmt: skip
        return [bool(f) for f in flags]

    def misses(self, items: list, n: int) -> int:
        """How many of ``items`` the reference workers must sample afresh (not cached)."""
        refs = [
            a.reference_misses.remote([items[j] for j in part], n)
            for a, part in zip(self.actors, self.parts(items), strict=True)
            if part
        ]
        return self.fleet.pending(refs, CallKind.REFERENCE_CACHE,
                       "rollout reference cache", read=sum).result()  # fmt: skip

    def submit_metrics(self) -> Pending[dict[str, float]]:
        """The workers' anchor-cache counters, read without waiting (right after a step's
        rollout, so it runs while the trainer works and ahead of anything queued on the
        workers later); :meth:`metrics` reads it. Nothing is sent without the cache."""
        if not self.caches_anchors:
            return Pending.ready({})
        return self.fleet.send(self.actors, lambda a: a.reference_metrics.remote(),
                               CallKind.REFERENCE_METRICS, "rollout reference metrics",
                               read=summed_counters)  # fmt: skip

    def metrics(self, queued: Pending[dict[str, float]] | None = None) -> dict[str, float]:
        """``anchor/cache_*`` summed over workers, of the read ``queued`` by
        :meth:`submit_metrics` (else read now); waits for the scores :meth:`remember_scores`
        sent first."""
        self.settle()
        return (queued or self.submit_metrics()).result()

    def submit_state(self, what: str = "rollout state") -> Pending[list[dict]]:
        """The workers' reference state (the anchor cache), read without waiting."""
        return self.fleet.send(self.actors, lambda a: a.state_dict.remote(), CallKind.CHECKPOINT,
                               what)  # fmt: skip

    def state_dicts(self) -> list[dict]:
        """The workers' reference state, after the scores :meth:`remember_scores` sent."""
        self.settle()
        return self.submit_state().result()

    def load_state_dicts(self, states: list[dict]) -> None:
        actors = self.actors
        if len(states) != len(actors):
            raise ValueError(
                f"checkpoint holds reference state of {len(states)} rollout workers, this run has "
                f"{len(actors)}; resume with the same rollout layout"
            )
        refs = [a.load_state_dict.remote(s) for a, s in zip(actors, states, strict=True)]
        self.fleet.pending(refs, CallKind.CHECKPOINT, "rollout state load").result()


def summed_counters(per_worker: list[dict[str, float]]) -> dict[str, float]:
    """The workers' ``anchor/cache_*`` counters summed."""
    out: dict[str, float] = {}
    for m in per_worker:
        for k, v in m.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def no_swap(needs_fresh: Callable[[], bool]) -> AbstractContextManager:
    """The :data:`ReferenceSwap` of a run whose reference needs no swap by the driver."""
    return nullcontext()


class RemoteEngine(RolloutEngine):
    """A :class:`RolloutEngine` view of the policy workers (for ``evaluation.evaluate``)."""

    def __init__(self, policy: PolicyDraws, default_seed: int | None = None):
        self.policy, self.default_seed = policy, default_seed

    def generate(self, prompts, n, params: SamplingParams, weights: str = "policy"):
        if params.seed is None and self.default_seed is not None:
            params = dataclasses.replace(params, seed=self.default_seed)
        return self.policy.generate_raw(prompts, n, params, weights)

    def update_weights(
        self, named_tensors: Iterable, version: int, weights: str = "policy"
    ) -> None:
        raise NotImplementedError("RemoteEngine is read-only; sync weights through WeightSync")

    def weight_version(self, weights: str = "policy") -> int:
        return self.policy.weight_versions()[0][weights]

    def health(self) -> bool:
        return True
