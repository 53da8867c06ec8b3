"""Unit tier: the anchor cache across several reference workers (``RolloutActors``).

Each worker keeps the cache entries of the queries it sampled, so a recurring query must go
back to the same worker whatever batch, position or call it comes in. The workers here are
real ``RolloutWorker`` methods on a scripted reference pool, called in-process through a
``.remote`` shim instead of Ray.
"""

from __future__ import annotations

import pytest

from megatron_armor.data.dataset import PromptItem
from megatron_armor.orchestration.actors import actor_handles
from megatron_armor.orchestration.actors.actor_handles import RolloutActors, query_worker, shard
from megatron_armor.orchestration.actors.workers import ComputeClock, RolloutWorker
from megatron_armor.rollout.protocol import GenerationOutput, SamplingParams
from megatron_armor.rollout.reference import CachedReferenceSampler, ReferenceSampler

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, seed=5)


class Pool(ReferenceSampler):
    """Fresh draws: token 5 (right) for even query numbers, 6 (wrong) for odd; the draw's seed
    in the second token, so a sample says which call drew it."""

    def sample(self, query_ids, prompts, n, params):
        return [[GenerationOutput([5 if int(q[1:]) % 2 == 0 else 6, params.seed], [0.0, 0.0],
                                  "stop", self.ref_version) for _ in range(n)]
                for q in query_ids]  # fmt: skip


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "right" if ids[0] == 5 else "wrong"


class Remote:
    """``actor.method.remote(*args)`` runs ``method`` now; the value stands in for its ref."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)
        call = type("Method", (), {"remote": staticmethod(method)})
        call.options = staticmethod(
            lambda **options: call
        )  # num_returns: the returned tuple itself
        return call


def worker() -> RolloutWorker:
    w = object.__new__(RolloutWorker)
    w.reference = CachedReferenceSampler(Pool())
    w.clock, w.tokenizer = ComputeClock(), Tokenizer()
    return w


def rollout_group() -> RolloutActors:
    group = object.__new__(RolloutActors)
    group.workers = [worker() for _ in range(3)]
    group.actors = group.reference_actors = [Remote(w) for w in group.workers]
    group.caches_anchors, group.weight_sync = True, None
    return group


@pytest.fixture
def actors(monkeypatch):
    monkeypatch.setattr(actor_handles, "wait", lambda refs, what, timeout=None, work=1.0: refs)
    return rollout_group()


def items(*numbers) -> list[PromptItem]:
    return [PromptItem(f"q{i}", [1, i], f"q{i}", "1", "tiny") for i in numbers]


def score(rows) -> None:
    for row in rows:
        for s in row:
            s.acc = s.response_text == "right"
            s.score = 1.0 if s.acc else -1.0


def test_a_query_always_reaches_the_worker_holding_its_cache_entry(actors):
    first = items(*range(12))
    rows = actors.sample_reference(first, 2, PARAMS)
    assert [row[0].query_id for row in rows] == [it.query_id for it in first]  # items order
    score(rows)
    actors.remember_reference_scores(first, rows)
    held = [set(w.reference.cache) for w in actors.workers]
    assert sorted(q for h in held for q in h) == sorted(it.query_id for it in first)  # once each
    assert all(held), "12 ids spread over all 3 workers"
    for i, h in enumerate(held):
        assert all(query_worker(q, 3) == i for q in h)

    again = items(11, 3, 0, 8, 5)  # other batch, other positions
    assert actors.reference_misses(again, 2) == 0
    rows_again = actors.sample_reference(again, 2, SamplingParams(temperature=1.0, seed=99))
    assert [r[0].response_ids for r in rows_again] == [
        rows[i][0].response_ids for i in (11, 3, 0, 8, 5)
    ]
    assert all(s.scored for row in rows_again for s in row)  # the remembered scores came back
    assert sum(w.reference.hits for w in actors.workers) == 5
    assert sum(w.reference.misses for w in actors.workers) == 12
    # rule (b)'s verdict from each query's own worker: odd numbers are never solved
    assert actors.reference_unsolved(again, 2) == [True, True, False, False, True]
    assert actors.reference_unsolved(items(12, 13), 2) == [False, False]  # not cached


def test_remembered_scores_are_waited_for_once_a_step(actors, monkeypatch):
    """``remember_reference_scores`` does not wait (the workers run the driver's calls in
    order); the step's ``reference_metrics`` (and a checkpoint's ``state_dicts``) wait for the
    calls sent since, so a failure there still stops the step."""
    waited = []
    monkeypatch.setattr(actor_handles, "wait", lambda refs, what, timeout=None, work=1.0: waited.append(
        (what, list(refs) if isinstance(refs, list) else refs)) or refs)  # fmt: skip
    for w in actors.workers:
        w.counted = {}
    first = items(*range(6))
    rows = actors.sample_reference(first, 2, PARAMS)
    score(rows)
    waited.clear()
    actors.remember_reference_scores(first, rows)
    assert waited == [] and len(actors._unsettled) == 3  # one call per worker, none waited
    metrics = actors.reference_metrics()
    assert [what for what, _ in waited] == ["rollout reference scores", "rollout reference metrics"]
    assert len(waited[0][1]) == 3 and actors._unsettled == ()
    assert metrics["anchor/cache_misses"] == 6
    waited.clear()
    actors.reference_metrics()  # nothing left to wait for
    assert [what for what, _ in waited] == ["rollout reference metrics"]
    # the loop queues the read right after the rollout and waits for it after training
    actors.sample_reference(items(20, 21), 2, PARAMS)
    waited.clear()
    queued = actors.submit_reference_metrics()
    assert waited == [] and len(queued) == 3
    assert actors.reference_metrics(queued)["anchor/cache_misses"] == 2
    assert [what for what, _ in waited] == ["rollout reference metrics"]
    actors.caches_anchors = False
    assert actors.submit_reference_metrics() == [] and actors.reference_metrics([]) == {}


def test_without_the_cache_the_workers_take_contiguous_parts(actors):
    actors.caches_anchors = False
    assert actors.reference_parts(items(*range(7))) == [[0, 1, 2], [3, 4], [5, 6]]
    actors.caches_anchors, actors.reference_actors = True, actors.reference_actors[:1]
    assert actors.reference_parts(items(*range(4))) == [[0, 1, 2, 3]]


def test_query_worker_is_stable_and_spreads_ids():
    assert [query_worker(f"q{i}", 4) for i in range(6)] == [
        query_worker(f"q{i}", 4) for i in range(6)
    ]
    counts = [0] * 4
    for i in range(4000):
        counts[query_worker(f"query-{i}", 4)] += 1
    assert min(counts) > 900  # about 1000 each


class Engine:
    """Policy samples: token 5 (right) for even query numbers (the prompt's second id), 6 for
    odd; the worker's seed in the second token."""

    def generate(self, prompts, n, params, weights):
        return [[GenerationOutput([5 if p[1] % 2 == 0 else 6, params.seed], [0.0, 0.0], "stop", 1)
                 for _ in range(n)] for p in prompts]  # fmt: skip


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

    group, scorers = object.__new__(RewardActors), []
    group.actors, group.verifier = [], "dapo"
    for _ in range(workers):
        w = object.__new__(RewardWorker)
        w.scorer = Scorer()
        scorers.append(w.scorer)
        group.actors.append(Remote(w))
    return group, scorers


def test_scoring_chained_to_a_generation_call_scores_what_the_call_drew(actors):
    """``submit_scored``: the rows of the plain call (same workers, parts and seeds); each
    rollout worker splits the answers of its samples not already scored into one part per
    scoring worker, which scores its part of every rollout worker's answers; the scores land
    on the right samples, and a cached anchor keeps its remembered score without being sent.
    The same for policy samples."""
    plain = rollout_group()
    reward, scorers = reward_group(2)
    for group in (actors, plain):  # the same cache in both: q0-q3 drawn, scored, remembered
        rows = group.sample_reference(items(0, 1, 2, 3), 2, PARAMS)
        score(rows)
        group.remember_reference_scores(items(0, 1, 2, 3), rows)
    mixed = items(5, 0, 7, 2, 4, 1, 9)  # hits q0, q2, q1; the others fresh
    expected = plain.sample_reference(mixed, 2, PARAMS)
    fresh = [s for row in expected for s in row if not s.scored]
    score([[s for s in fresh]])
    call = actors.submit_scored("sample_reference", mixed, 2, PARAMS, reward)
    chained = call.rows()
    stats = call.score()
    key = lambda rows: [[(s.query_id, s.response_ids, s.score, s.acc, s.scored) for s in row]  # noqa: E731
                        for row in rows]  # fmt: skip
    assert key(chained) == key(expected)
    assert stats == {"reward/n": 8.0} and len(fresh) == 8  # 4 fresh queries x 2
    # each rollout worker splits its fresh answers in two; scorer k gets part k of each, once
    fresh_by_worker = [
        [s.response_text for j in part for s in chained[j] if not s.scored]
        for part in actors.reference_parts(mixed) if part
    ]  # fmt: skip
    for k, scorer in enumerate(scorers):
        assert scorer.given[-1] == [t for texts in fresh_by_worker for t in shard(texts, 2)[k]]
    assert sum(len(sc.given[-1]) for sc in scorers) == 8  # every fresh answer, once

    for group in (actors, plain):
        group.policy_actors = group.actors
        for w in group.workers:
            w.engine = Engine()
    expected = plain.generate(items(*range(5)), 3, PARAMS)
    score(expected)
    call = actors.submit_scored("generate", items(*range(5)), 3, PARAMS, reward)
    assert key(call.rows()) != key(expected)  # not scored yet
    assert call.score() == {"reward/n": 15.0} and key(call.rows()) == key(expected)
    with pytest.raises(ValueError, match="no generation call 'validate'"):
        actors.submit_scored("validate", items(1), 1, PARAMS, reward)


def test_a_call_sent_without_waiting_for_its_rows_gives_the_same_rows_and_scores(actors):
    """``submit_scored(..., wait_rows=False)`` (the next step's reference call sent while the
    trainer works): nothing is read back until asked for; then the rows and scores of the
    waited call. Refused where the driver swaps the reference into the policy servers: the
    policy must not go back before the rows are in."""
    plain = rollout_group()
    reward, _ = reward_group(2)
    expected = plain.submit_scored("sample_reference", items(0, 4, 2), 2, PARAMS, reward)
    call = actors.submit_scored("sample_reference", items(0, 4, 2), 2, PARAMS, reward,
                                wait_rows=False)  # fmt: skip
    assert call._rows is None
    key = lambda rows: [[(s.response_ids, s.score, s.acc) for s in row] for row in rows]  # noqa: E731
    assert call.score() == expected.score() and key(call.rows()) == key(expected.rows())

    class Swapping:
        def swaps_into_policy_servers(self):
            return True

    actors.weight_sync = Swapping()
    with pytest.raises(ValueError, match="swapped into the policy servers"):
        actors.submit_scored("sample_reference", items(1), 2, PARAMS, reward, wait_rows=False)
