"""RewardScorer and the scoring pool: verifier choice, overlong penalty, timeouts, throughput.

Tier: unit (spawns 2 verifier processes on the CPU; every run is bounded by the pool's
per-item timeout and by pytest-timeout).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_armor.reward import RewardScorer, auto_verifier, overlong_penalty
from megatron_armor.reward.pool import Job, RewardPoolError, ScoringPool
from megatron_armor.types import Sample

pytestmark = pytest.mark.unit

TIMEOUT_S = 2.0
POWER_TOWER = "Answer: $9^{9^{9^{9^{9}}}}$"


def sample(text: str, truth: str, source: str, response_len: int = 4) -> Sample:
    return Sample(
        query_id="q",
        prompt_ids=[1],
        response_ids=[0] * response_len,
        response_text=text,
        ground_truth=truth,
        data_source=source,
    )


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(
        timeout_s=TIMEOUT_S, num_workers=2, overlong_buffer=16, max_new_tokens=64
    ) as s:
        yield s


@pytest.mark.parametrize(
    ("source", "verifier"),
    [
        ("math_dapo", "dapo"),
        ("tiny_arith", "dapo"),
        ("DAPO-Math-17k", "dapo"),
        ("aime24", "math_verify"),
        ("AIME-2025", "math_verify"),
        ("amc23", "math_verify"),
        ("MATH-500", "math_verify"),
    ],
)
def test_auto_table(source, verifier):
    assert auto_verifier(source) == verifier


def test_unknown_data_source_is_a_clear_error(scorer):
    with pytest.raises(ValueError, match=r"data_source='my_bench' is not in the reward.verifier"):
        scorer.score([sample("Answer: 1", "1", "math_dapo"), sample("Answer: 1", "1", "my_bench")])
    with pytest.raises(ValueError, match="reward.verifier='sympy'"):
        RewardScorer(verifier="sympy")


def test_explicit_verifier_overrides_the_table():
    # dapo rule: exact match, so 0.5 != 1/2; the data_source is not looked up at all
    with RewardScorer(verifier="dapo", num_workers=1, overlong_enabled=False) as s:
        samples = [sample("Answer: 0.5", "\\frac{1}{2}", "my_bench"), sample("Answer: 3", "3", "x")]
        s.score(samples)
    assert [x.acc for x in samples] == [False, True]


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (40, 0.0), (48, 0.0), (52, -0.25), (56, -0.5), (60, -0.75), (64, -1.0)],
)
def test_overlong_penalty_values(length, expected):
    # max_len 64, buffer 16: expected length 48, linear ramp to -factor at 64
    assert overlong_penalty(length, 64, 16, 1.0) == pytest.approx(expected)
    assert overlong_penalty(length, 64, 16, 0.5) == pytest.approx(expected / 2)


def test_overlong_settings_are_checked():
    with pytest.raises(ValueError, match="reward.overlong.buffer=100"):
        RewardScorer(overlong_buffer=100, max_new_tokens=64)
    RewardScorer(overlong_enabled=False, overlong_buffer=100, max_new_tokens=64).close()


def test_score_sets_acc_and_score_with_penalty(scorer):
    samples = [
        sample("Answer: 7", "7", "math_dapo", response_len=10),
        sample("Answer: 7", "7", "math_dapo", response_len=56),
        sample("Answer: 8", "7", "math_dapo", response_len=64),
        sample("Answer: 0.5", "\\frac{1}{2}", "aime24", response_len=10),
        sample("I do not know", "7", "math_dapo", response_len=10),
    ]
    stats = scorer.score(samples)
    assert [s.acc for s in samples] == [True, True, False, True, False]
    assert [s.score for s in samples] == pytest.approx([1.0, 0.5, -2.0, 1.0, -1.0])
    assert stats["reward/acc"] == pytest.approx(0.6)
    assert stats["reward/no_answer_frac"] == pytest.approx(0.2)
    assert stats["reward/overlong_frac"] == pytest.approx(0.4)
    assert stats["reward/timeouts"] == 0


def test_scoring_workers_get_answers_only(scorer, monkeypatch):
    """``RewardActors.score`` (the loop's scoring): each worker gets the samples' ``Answer``
    (text, length, ground truth, data source; the DAPO rule's text cut to the tail it reads),
    pickled as Ray would, never the token ids or log-probs; the scores and stats are those of
    scoring the samples in-process."""
    import pickle

    from megatron_armor.orchestration.actors.actor_handles import RewardActors
    from megatron_armor.orchestration.actors.workers import RewardWorker
    from megatron_armor.reward.dapo_rule import TAIL_CHARS
    from megatron_armor.reward.scorer import Answer

    worker, sent = object.__new__(RewardWorker), []
    worker.scorer = scorer

    class Handle:  # ``actor.score.remote(answers)``, run now on a pickled copy
        class score:  # noqa: N801
            @staticmethod
            def remote(answers):
                sent.append(pickle.loads(pickle.dumps(answers)))
                return worker.score(sent[-1])

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from inprocess_actors import InstantWatch

    actors = RewardActors(InstantWatch(), [Handle(), Handle()], scorer.verifier)

    def batch() -> list[Sample]:
        long = "work " * 400 + "Answer: 7"  # far longer than the DAPO rule's tail
        out = [
            sample(long, "7", "math_dapo", response_len=60),
            sample("Answer: 8", "7", "math_dapo", response_len=10),
            sample(long.replace("Answer: 7", "so $\\frac{1}{2}$"), "0.5", "aime24"),
        ]
        for s in out:
            s.response_logprobs = [-0.5] * s.response_len
        return out

    remote, local = batch(), batch()
    stats = actors.score(remote)
    want = scorer.score(local)
    assert [(s.score, s.acc) for s in remote] == [(s.score, s.acc) for s in local]
    assert [s.acc for s in remote] == [True, False, True]
    stats.pop("reward/verify_seconds"), want.pop("reward/verify_seconds")
    assert stats == pytest.approx(want)
    answers = [a for part in sent for a in part]
    assert [type(a) for a in answers] == [Answer] * 3
    assert len(answers[0].text) == TAIL_CHARS and answers[0].length == 60
    assert answers[2].text == local[2].response_text  # math-verify reads all of it


def test_the_dapo_rule_runs_in_the_scoring_process_with_the_pools_verdicts(monkeypatch):
    """``dapo`` answers are verified in the scorer's own process (no pool process starts for
    a batch of them) with the verdicts the pool gives the same jobs; a rule that raises is an
    ``error`` verdict, counted, and the batch completes; mixed batches keep their order."""
    from megatron_armor.reward import verifiers

    jobs = [
        Job("dapo", f"x\nAnswer: {t}", g)
        for t, g in [
            ("7", "7"),
            ("8", "7"),
            ("1,000", "1000"),
            ("\\frac12", "\\frac{1}{2}"),
            ("", "3"),
        ]
    ]
    with RewardScorer(verifier="dapo", num_workers=1, max_new_tokens=64) as inline:
        samples = [sample(j.response, j.ground_truth, "math_dapo") for j in jobs]
        stats = inline.score(samples)
        assert inline.pool._workers == []  # nothing spawned
        pooled, _ = inline.pool.run(jobs)
        assert [(s.acc, s.score) for s in samples] == [
            (v.correct, 1.0 if v.correct else -1.0) for v in pooled
        ]
        assert [s.acc for s in samples] == [True, False, True, True, False]
        assert stats["reward/errors"] == 0

        def rule(response, truth):
            if "boom" in response:
                raise ValueError("boom")
            return verifiers.score_dapo(response, truth)

        monkeypatch.setitem(verifiers.VERIFIERS, "dapo", rule)
        samples = [sample("Answer: boom", "1", "math_dapo"), sample("Answer: 2", "2", "math_dapo")]
        stats = inline.score(samples)
        assert [s.acc for s in samples] == [False, True] and stats["reward/errors"] == 1


def test_from_config_reads_reward_settings():
    cfg = SimpleNamespace(
        verifier="dapo",
        timeout_s=3.0,
        num_workers=1,
        overlong=SimpleNamespace(enabled=True, buffer=8, factor=0.5),
    )
    s = RewardScorer.from_config(cfg, max_new_tokens=32)
    assert (s.verifier, s.pool.timeout_s, s.pool.num_workers) == ("dapo", 3.0, 1)
    assert s.penalty(32) == pytest.approx(-0.5)
    s.close()


def test_pathological_answer_times_out_and_is_counted(scorer):
    samples = [sample(POWER_TOWER, "5", "aime24")] + [
        sample(f"Answer: {i}", str(i), "aime24") for i in range(6)
    ]
    start = time.monotonic()
    stats = scorer.score(samples)
    elapsed = time.monotonic() - start
    print(f"power tower scored in {elapsed:.2f} s (timeout {TIMEOUT_S} s)")
    assert not samples[0].acc and samples[0].score == -1.0
    assert all(s.acc for s in samples[1:])
    assert stats["reward/timeouts"] == 1
    assert elapsed < TIMEOUT_S + scorer.pool.kill_grace_s + 1.5


@pytest.mark.timeout(60)
def test_stuck_worker_is_killed_and_replaced(scorer):
    """A worker frozen in the middle of a chunk (as in a C call that never yields) is
    killed after timeout + grace; its item is a timeout and the rest of the batch completes."""
    pool = scorer.pool
    pool.start()  # both workers up and ready; the first chunk goes to worker 0
    stuck = pool._workers[0].process.pid
    os.kill(stuck, signal.SIGSTOP)
    jobs = [Job("dapo", f"Answer: {i}", str(i)) for i in range(40)]
    start = time.monotonic()
    verdicts, stats = pool.run(jobs)
    elapsed = time.monotonic() - start
    assert stats.timeouts == 1 and stats.worker_restarts == 1
    assert [v.status for v in verdicts].count("timeout") == 1
    assert all(v.correct for v in verdicts if v.status == "ok")
    assert len(verdicts) == 40 and elapsed < TIMEOUT_S + pool.kill_grace_s + 10
    assert stuck not in [w.process.pid for w in pool._workers]


def kill_when_busy(worker) -> None:
    """SIGKILL ``worker`` shortly after it starts on a chunk."""
    deadline = time.monotonic() + 30
    while not worker.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(worker.process.pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_dead_worker_marks_its_item_and_the_batch_completes(scorer):
    """A worker that dies mid-item (e.g. killed for memory) yields an ``error`` verdict."""
    pool = scorer.pool
    pool.start()
    victim = pool._workers[0]  # gets the first chunk: the power tower
    killer = threading.Thread(target=kill_when_busy, args=(victim,))
    jobs = [Job("math_verify", POWER_TOWER, "5")] + [
        Job("dapo", f"Answer: {i}", str(i)) for i in range(1, 9)
    ]
    killer.start()
    verdicts, stats = pool.run(jobs)
    killer.join()
    assert verdicts[0].status == "error" and not verdicts[0].correct
    assert stats.errors == 1 and stats.worker_restarts == 1
    assert all(v.correct and v.status == "ok" for v in verdicts[1:])


@pytest.mark.timeout(60)
def test_worker_stopped_mid_chunk_loses_only_the_item_under_way(scorer):
    """Stopped (as in a C call that never yields) after verifying items it has not sent yet,
    a worker is killed; the shared index names the item it was on (a timeout), the unsent
    answers are verified again, every other verdict is right."""
    pool = scorer.pool
    pool.start()  # both workers up and ready; the first chunk (items 0-4) goes to worker 0
    worker = pool._workers[0]
    # math-verify takes milliseconds an answer: the stop lands before the chunk's end
    jobs = [Job("math_verify", f"Answer: {i}/2", f"\\frac{{{i}}}{{2}}") for i in range(40)]

    def stop_at_item(index: int) -> None:
        deadline = time.monotonic() + 30
        while worker.current.value < index and time.monotonic() < deadline:
            time.sleep(0)  # the worker writes the index before each item
        os.kill(worker.process.pid, signal.SIGSTOP)

    stopper = threading.Thread(target=stop_at_item, args=(2,))
    stopper.start()
    try:
        verdicts, stats = pool.run(jobs)
    finally:
        stopper.join()
    timed_out = [i for i, v in enumerate(verdicts) if v.status == "timeout"]
    assert len(timed_out) == 1 and 2 <= timed_out[0] <= 4
    assert stats.timeouts == 1 and stats.worker_restarts == 1
    assert all(v.correct for i, v in enumerate(verdicts) if i not in timed_out)


@pytest.mark.timeout(60)
def test_a_worker_that_died_while_idle_is_replaced_and_counted():
    """Killed between batches (as by the OOM killer), a worker is replaced when the next batch
    starts, and that batch's stats count the restart (``reward/worker_restarts``)."""
    pool = ScoringPool(num_workers=2, timeout_s=TIMEOUT_S)
    try:
        pool.start()
        victim = pool._workers[0].process
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)  # reaped: the death is a fact before the batch starts
        assert victim.exitcode == -signal.SIGKILL
        verdicts, stats = pool.run([Job("dapo", f"Answer: {i}", str(i)) for i in range(8)])
        assert stats.worker_restarts == 1 and stats.errors == 0
        assert all(v.correct for v in verdicts) and victim.pid not in pool_pids(pool)
        assert pool.run([Job("dapo", "Answer: 1", "1")])[1].worker_restarts == 0  # counted once
    finally:
        pool.close()


def pool_pids(pool: ScoringPool) -> list[int]:
    return [w.process.pid for w in list(pool._workers)]


def kill_workers_while_starting(pool: ScoringPool, count: int, killed: list[int]) -> None:
    """SIGKILL every worker process ``pool`` starts, as soon as its pid is there (long before
    its imports let it report ready), until ``count`` were killed (bounded)."""
    deadline = time.monotonic() + 50
    while len(killed) < count and time.monotonic() < deadline:
        for worker in list(pool._workers):
            if not worker.ready and worker.process.pid not in killed:
                os.kill(worker.process.pid, signal.SIGKILL)
                killed.append(worker.process.pid)
        time.sleep(0.001)


@pytest.mark.timeout(120)
def test_a_worker_that_dies_while_starting_is_started_again_after_a_back_off():
    """Killed before it is ready, a worker is started again after a back-off; one less than
    ``START_ATTEMPTS`` deaths in a row leave a pool that starts and scores, every restart
    counted in the next batch's stats."""
    from megatron_armor.reward.pool import START_ATTEMPTS

    pool, killed = ScoringPool(num_workers=1, timeout_s=TIMEOUT_S), []
    killer = threading.Thread(target=kill_workers_while_starting,
                              args=(pool, START_ATTEMPTS - 1, killed))  # fmt: skip
    killer.start()
    try:
        pool.start()
        killer.join()
        verdicts, stats = pool.run([Job("dapo", "Answer: 3", "3")])
        assert len(killed) == START_ATTEMPTS - 1 and verdicts[0].correct
        assert stats.worker_restarts == START_ATTEMPTS - 1
        assert not set(killed) & set(pool_pids(pool))
    finally:
        killer.join()
        pool.close()


@pytest.mark.timeout(120)
def test_workers_that_keep_dying_while_starting_stop_the_pool_naming_verifier_and_exit_code():
    from megatron_armor.reward.pool import START_ATTEMPTS

    pool, killed = ScoringPool(num_workers=1, timeout_s=TIMEOUT_S, verifier="math_verify"), []
    killer = threading.Thread(target=kill_workers_while_starting,
                              args=(pool, START_ATTEMPTS, killed))  # fmt: skip
    killer.start()
    try:
        with pytest.raises(RewardPoolError) as err:
            pool.start()
    finally:
        killer.join()
        pool.close()
    message = str(err.value)
    assert f"exited while starting {START_ATTEMPTS} times in a row" in message, message
    assert "reward.verifier='math_verify'" in message and "-9 (killed by SIGKILL)" in message


@pytest.mark.parametrize(
    ("workers", "jobs", "size"),
    [(1, 40, 40), (1, 256, 64), (1, 1000, 64), (2, 40, 5), (2, 256, 32), (2, 1000, 64)],
)
def test_chunks_balance_several_workers_and_spare_a_single_one_round_trips(workers, jobs, size):
    assert ScoringPool(num_workers=workers).chunk_size(jobs) == size


@pytest.mark.timeout(120)
def test_thousand_answers_in_parallel(scorer):
    cases = [
        ("Answer: {n}", "{n}", "math_dapo", True),
        ("Answer: {n}1", "{n}", "math_dapo", False),
        ("Answer: 1,{n:03d}", "1{n:03d}", "math_dapo", True),
        ("Answer: \\frac{{{n}}}{{2}}", "{half}", "aime24", True),
        ("Answer: {n}", "{m}", "amc23", False),
        ("so \\boxed{{{n}}}", "{n}", "aime25", True),
    ]
    samples, expected = [], []
    for i in range(1000):
        text, truth, source, correct = cases[i % len(cases)]
        n = i % 97 + 2
        fields = {"n": n, "m": n + 1, "half": n / 2}
        samples.append(sample(text.format(**fields), truth.format(**fields), source))
        expected.append(correct)
    scorer.start()  # time the scoring, not the start of a replaced worker
    start = time.monotonic()
    stats = scorer.score(samples)
    elapsed = time.monotonic() - start
    print(f"1000 answers on 2 workers: {elapsed:.2f} s ({1000 / elapsed:.0f} answers/s)")
    assert [s.acc for s in samples] == expected
    assert stats["reward/timeouts"] == 0 and stats["reward/errors"] == 0
    assert elapsed < 60
