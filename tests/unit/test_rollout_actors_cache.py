"""Unit tier: the anchor cache across several reference workers (``rollout_draws.ReferenceDraws``).

Each worker keeps the cache entries of the queries it sampled, so a recurring query must go
back to the same worker whatever batch, position or call it comes in. The workers here are
the real worker services (``rollout_services.py``) on a scripted reference pool and engine,
called in-process (``tests/inprocess_actors.py``) instead of through Ray.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest

from megatron_armor.data.dataset import PromptItem
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.rollout_draws import (
    PolicyDraws,
    ReferenceDraws,
    query_worker,
)
from megatron_armor.orchestration.actors.rollout_services import (
    EnginePools,
    GenerationService,
    ReferenceService,
)
from megatron_armor.orchestration.actors.workers import ComputeClock, shard
from megatron_armor.rollout.protocol import GenerationOutput, SamplingParams
from megatron_armor.rollout.reference import CachedReferenceSampler, ReferenceSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inprocess_actors import InstantWatch, Remote, local_fleet  # noqa: E402

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, seed=5)


class Pool(ReferenceSampler):
    """Fresh draws: token 5 (right) for even query numbers, 6 (wrong) for odd; the draw's seed
    in the second token, so a sample says which call drew it."""

    def sample(self, query_ids, prompts, n, params):
        return [[GenerationOutput([5 if int(q[1:]) % 2 == 0 else 6, params.seed], [0.0, 0.0],
                                  "stop", self.ref_version) for _ in range(n)]
                for q in query_ids]  # fmt: skip


class Engine:
    """Policy samples: token 5 (right) for even query numbers (the prompt's second id), 6 for
    odd; the worker's seed in the second token."""

    def generate(self, prompts, n, params, weights):
        return [[GenerationOutput([5 if p[1] % 2 == 0 else 6, params.seed], [0.0, 0.0], "stop", 1)
                 for _ in range(n)] for p in prompts]  # fmt: skip


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "right" if ids[0] == 5 else "wrong"


class Worker(GenerationService, ReferenceService):
    """The generation and reference services of a rollout worker over :class:`Engine` and an
    anchor cache filled by :class:`Pool`."""

    def __init__(self):
        clock, tokenizer = ComputeClock(), Tokenizer()
        GenerationService.__init__(self, EnginePools({"policy": Engine()}, 0), tokenizer, clock)
        ReferenceService.__init__(self, CachedReferenceSampler(Pool()), tokenizer, clock)


def no_swap(needs_fresh):
    return nullcontext()


def rollout_group(watch=None, caches_anchors=True, swaps=False):
    """``(policy draws, reference draws, workers)`` over three in-process workers."""
    workers = [Worker() for _ in range(3)]
    fleet = local_fleet(workers, watch=watch)
    reference = ReferenceDraws(fleet, caches_anchors, no_swap, swaps)
    return PolicyDraws(fleet), reference, workers


@pytest.fixture
def group():
    return rollout_group()


def items(*numbers) -> list[PromptItem]:
    return [PromptItem(f"q{i}", [1, i], f"q{i}", "1", "tiny") for i in numbers]


def score(rows) -> None:
    for row in rows:
        for s in row:
            s.acc = s.response_text == "right"
            s.score = 1.0 if s.acc else -1.0


def test_a_query_always_reaches_the_worker_holding_its_cache_entry(group):
    _, reference, workers = group
    first = items(*range(12))
    rows = reference.sample(first, 2, PARAMS)
    assert [row[0].query_id for row in rows] == [it.query_id for it in first]  # items order
    score(rows)
    reference.remember_scores(first, rows)
    held = [set(w.reference.cache) for w in workers]
    assert sorted(q for h in held for q in h) == sorted(it.query_id for it in first)  # once each
    assert all(held), "12 ids spread over all 3 workers"
    for i, h in enumerate(held):
        assert all(query_worker(q, 3) == i for q in h)

    again = items(11, 3, 0, 8, 5)  # other batch, other positions
    assert reference.misses(again, 2) == 0
    rows_again = reference.sample(again, 2, SamplingParams(temperature=1.0, seed=99))
    assert [r[0].response_ids for r in rows_again] == [
        rows[i][0].response_ids for i in (11, 3, 0, 8, 5)
    ]
    assert all(s.scored for row in rows_again for s in row)  # the remembered scores came back
    assert sum(w.reference.hits for w in workers) == 5
    assert sum(w.reference.misses for w in workers) == 12
    # rule (b)'s verdict from each query's own worker: odd numbers are never solved
    assert reference.unsolved(again, 2) == [True, True, False, False, True]
    assert reference.unsolved(items(12, 13), 2) == [False, False]  # not cached


def test_remembered_scores_are_waited_for_once_a_step():
    """``remember_scores`` does not wait (the workers run the driver's calls in order); the
    step's ``metrics`` (and a checkpoint's ``state_dicts``) wait for the calls sent since, so
    a failure there still stops the step."""
    watch = InstantWatch()
    _, reference, _ = rollout_group(watch)
    first = items(*range(6))
    rows = reference.sample(first, 2, PARAMS)
    score(rows)
    watch.waits.clear()
    reference.remember_scores(first, rows)
    (sent,) = reference.unsettled
    assert watch.waits == [] and len(sent.refs) == 3  # one call per worker, none waited
    metrics = reference.metrics()
    assert watch.waits == [(CallKind.REFERENCE_SCORES, "rollout reference scores"),
                           (CallKind.REFERENCE_METRICS, "rollout reference metrics")]  # fmt: skip
    assert reference.unsettled == []
    assert metrics["anchor/cache_misses"] == 6
    watch.waits.clear()
    reference.metrics()  # nothing left to wait for
    assert [kind for kind, _ in watch.waits] == [CallKind.REFERENCE_METRICS]
    # the loop sends the read right after the rollout and waits for it after training
    reference.sample(items(20, 21), 2, PARAMS)
    watch.waits.clear()
    queued = reference.submit_metrics()
    assert watch.waits == [] and len(queued.refs) == 3
    assert reference.metrics(queued)["anchor/cache_misses"] == 2
    assert [kind for kind, _ in watch.waits] == [CallKind.REFERENCE_METRICS]
    _, uncached, _ = rollout_group(watch, caches_anchors=False)
    watch.waits.clear()
    assert uncached.submit_metrics().refs == [] and uncached.metrics() == {}
    assert watch.waits == []  # no call without the cache


def test_without_the_cache_the_workers_take_contiguous_parts():
    _, reference, _ = rollout_group(caches_anchors=False)
    assert reference.parts(items(*range(7))) == [[0, 1, 2], [3, 4], [5, 6]]
    single = ReferenceDraws(local_fleet([Worker()]), True, no_swap, False)
    assert single.parts(items(*range(4))) == [[0, 1, 2, 3]]


def test_query_worker_is_stable_and_spreads_ids():
    assert [query_worker(f"q{i}", 4) for i in range(6)] == [
        query_worker(f"q{i}", 4) for i in range(6)
    ]
    counts = [0] * 4
    for i in range(4000):
        counts[query_worker(f"query-{i}", 4)] += 1
    assert min(counts) > 900  # about 1000 each


class Scorer:
    """``score_answers`` of a ``RewardScorer``: right answers +1, the others -1; records what
    each scoring worker was given."""

    def __init__(self):
        self.given = []

    def score_answers(self, answers):
        self.given.append([a.text for a in answers])
        scored = [(1.0, True) if a.text == "right" else (-1.0, False) for a in answers]
        return scored, {"reward/n": float(len(answers))}


def reward_group(workers: int):
    from megatron_armor.orchestration.actors.actor_handles import RewardActors
    from megatron_armor.orchestration.actors.workers import RewardWorker

    actors, scorers = [], []
    for _ in range(workers):
        w = object.__new__(RewardWorker)  # its scorer alone: no process pool
        w.scorer = Scorer()
        scorers.append(w.scorer)
        actors.append(Remote(w))
    return RewardActors(InstantWatch(), actors, "dapo"), scorers


def test_scoring_chained_to_a_generation_call_scores_what_the_call_drew(group):
    """``submit_scored``: the rows of the plain call (same workers, parts and seeds); each
    rollout worker splits the answers of its samples not already scored into one part per
    scoring worker, which scores its part of every rollout worker's answers; the scores land
    on the right samples, and a cached anchor keeps its remembered score without being sent.
    The same for policy samples."""
    policy, reference, _ = group
    plain_policy, plain, _ = rollout_group()
    reward, scorers = reward_group(2)
    for draws in (reference, plain):  # the same cache in both: q0-q3 drawn, scored, remembered
        rows = draws.sample(items(0, 1, 2, 3), 2, PARAMS)
        score(rows)
        draws.remember_scores(items(0, 1, 2, 3), rows)
    mixed = items(5, 0, 7, 2, 4, 1, 9)  # hits q0, q2, q1; the others fresh
    expected = plain.sample(mixed, 2, PARAMS)
    fresh = [s for row in expected for s in row if not s.scored]
    score([[s for s in fresh]])
    call = reference.submit_scored(mixed, 2, PARAMS, reward)
    chained = call.rows()
    stats = call.score()
    key = lambda rows: [[(s.query_id, s.response_ids, s.score, s.acc, s.scored) for s in row]  # noqa: E731
                        for row in rows]  # fmt: skip
    assert key(chained) == key(expected)
    assert stats == {"reward/n": 8.0} and len(fresh) == 8  # 4 fresh queries x 2
    # each rollout worker splits its fresh answers in two; scorer k gets part k of each, once
    fresh_by_worker = [
        [s.response_text for j in part for s in chained[j] if not s.scored]
        for part in reference.parts(mixed) if part
    ]  # fmt: skip
    for k, scorer in enumerate(scorers):
        assert scorer.given[-1] == [t for texts in fresh_by_worker for t in shard(texts, 2)[k]]
    assert sum(len(sc.given[-1]) for sc in scorers) == 8  # every fresh answer, once

    expected = plain_policy.generate(items(*range(5)), 3, PARAMS)
    score(expected)
    call = policy.submit_scored(items(*range(5)), 3, PARAMS, reward)
    assert key(call.rows()) != key(expected)  # not scored yet
    assert call.score() == {"reward/n": 15.0} and key(call.rows()) == key(expected)


def test_a_call_sent_without_waiting_for_its_rows_gives_the_same_rows_and_scores(group):
    """``submit_scored(..., wait_rows=False)`` (the next step's reference call sent while the
    trainer works): nothing is waited for until asked; then the rows and scores of the waited
    call. Refused where the driver swaps the reference into the policy servers: the policy
    must not go back before the rows are in."""
    watch = InstantWatch()
    _, reference, _ = rollout_group(watch)
    _, plain, _ = rollout_group()
    reward, _ = reward_group(2)
    expected = plain.submit_scored(items(0, 4, 2), 2, PARAMS, reward)
    call = reference.submit_scored(items(0, 4, 2), 2, PARAMS, reward, wait_rows=False)
    assert watch.waits == []
    key = lambda rows: [[(s.response_ids, s.score, s.acc) for s in row] for row in rows]  # noqa: E731
    assert call.score() == expected.score() and key(call.rows()) == key(expected.rows())

    _, swapping, _ = rollout_group(swaps=True)
    with pytest.raises(ValueError, match="swapped into the policy servers"):
        swapping.submit_scored(items(1), 2, PARAMS, reward, wait_rows=False)
