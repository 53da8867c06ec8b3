"""RewardScorer: verify a batch of samples in the scoring pool, set ``score`` and ``acc``.

For each sample (docs/data_reward.md):

    acc   = verifier(response_text, ground_truth)           # dapo | math_verify, per data_source
    score = (+1 if acc else -1) + overlong_penalty(response_len)

A verification that times out or fails counts as wrong (``acc = False``) and is counted in
``reward/timeouts`` / ``reward/errors``. Verifier names are resolved for the whole batch
before any work starts, so an unknown ``data_source`` fails fast.

Where: math-verify in the scoring pool's processes, each answer under a time limit
(``reward/pool.py``); the DAPO rule in the scoring process itself (:data:`INLINE_VERIFIERS`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_armor.reward.dapo_rule import TAIL_CHARS
from megatron_armor.reward.overlong import check_overlong, overlong_penalty
from megatron_armor.reward.pool import Job, PoolStats, ScoringPool, Verdict, verify_inline
from megatron_armor.reward.verifiers import check_verifier, resolve_verifier

if TYPE_CHECKING:
    from megatron_armor.types import Sample


INLINE_VERIFIERS = frozenset({"dapo"})
"""Verifiers run in the scoring process, not the pool: the DAPO rule reads at most
:data:`TAIL_CHARS` characters of a response (and its ground truth, normalized once) with
patterns whose cost grows at most with the square of that, a few microseconds an answer, so
it cannot hang; a pool round trip would cost more than the verifying (~1 ms against 0.2 ms
for 112 answers). Its exceptions are ``error`` verdicts, as in the pool."""


@dataclass(frozen=True)
class Answer:
    """What scoring reads of a :class:`Sample`, and all a scoring worker in another process is
    sent: not the prompt, the token ids or the log-probs (at the paper's lengths, thousands
    of numbers a response that the verifiers never look at)."""

    text: str
    length: int
    """Response tokens (the overlong penalty)."""
    ground_truth: str
    data_source: str


def answers_of(samples: list[Sample], verifier: str) -> list[Answer]:
    """:class:`Answer` of each sample, for ``reward.verifier = verifier``; the DAPO rule reads
    only the last :data:`TAIL_CHARS` characters, so only they are kept for it."""
    out = []
    for s in samples:
        text = s.response_text
        if resolve_verifier(verifier, s.data_source) == "dapo":
            text = text[-TAIL_CHARS:]
        out.append(Answer(text, s.response_len, s.ground_truth, s.data_source))
    return out


class RewardScorer:
    """Scores samples in place; returns ``reward/*`` stats. Call :meth:`close` when done."""

    def __init__(
        self,
        verifier: str = "auto",
        timeout_s: float = 5.0,
        num_workers: int = 2,
        overlong_enabled: bool = True,
        overlong_buffer: int = 16,
        overlong_factor: float = 1.0,
        max_new_tokens: int = 64,
    ):
        check_verifier(verifier)
        if overlong_enabled:
            check_overlong(max_new_tokens, overlong_buffer, overlong_factor)
        self.verifier = verifier
        self.overlong_enabled = overlong_enabled
        self.overlong_buffer = overlong_buffer
        self.overlong_factor = overlong_factor
        self.max_new_tokens = max_new_tokens
        self.pool = ScoringPool(num_workers=num_workers, timeout_s=timeout_s, verifier=verifier)

    @classmethod
    def from_config(cls, reward_cfg: Any, max_new_tokens: int) -> RewardScorer:
        """From a ``RewardConfig`` (``config.reward``) and ``rollout.max_new_tokens``."""
        return cls(
            verifier=reward_cfg.verifier,
            timeout_s=reward_cfg.timeout_s,
            num_workers=reward_cfg.num_workers,
            overlong_enabled=reward_cfg.overlong.enabled,
            overlong_buffer=reward_cfg.overlong.buffer,
            overlong_factor=reward_cfg.overlong.factor,
            max_new_tokens=max_new_tokens,
        )

    def penalty(self, response_len: int) -> float:
        """The overlong penalty of a response of ``response_len`` tokens (0 when disabled)."""
        if not self.overlong_enabled:
            return 0.0
        return overlong_penalty(
            response_len, self.max_new_tokens, self.overlong_buffer, self.overlong_factor
        )

    def _job(self, answer: Answer) -> Job:
        # the DAPO rule's answers hold only the tail it reads (answers_of)
        return Job(resolve_verifier(self.verifier, answer.data_source), answer.text,
                   answer.ground_truth)  # fmt: skip

    def verify(self, answers: list[Answer]) -> tuple[list[Verdict], dict[str, float]]:
        """Verdicts for ``answers`` (:data:`INLINE_VERIFIERS` here, the others in the pool;
        the pool starts on its first job) and the counters."""
        start = time.monotonic()
        jobs = [self._job(a) for a in answers]
        verdicts: list[Verdict | None] = [None] * len(jobs)
        pooled = [i for i, job in enumerate(jobs) if job.verifier not in INLINE_VERIFIERS]
        pool = PoolStats()
        if pooled:
            done, pool = self.pool.run([jobs[i] for i in pooled])
            for i, verdict in zip(pooled, done, strict=True):
                verdicts[i] = verdict
        for i, job in enumerate(jobs):
            if verdicts[i] is None:
                verdicts[i] = verify_inline(job)
                pool.errors += verdicts[i].status == "error"
        pool.seconds = time.monotonic() - start
        counters = {
            "reward/timeouts": float(pool.timeouts),
            "reward/errors": float(pool.errors),
            "reward/worker_restarts": float(pool.worker_restarts),
            "reward/verify_seconds": pool.seconds,
        }
        return verdicts, counters

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set ``sample.acc`` and ``sample.score`` in place; return ``reward/*`` stats."""
        scored, stats = self.score_answers(answers_of(samples, self.verifier))
        for sample, (score, acc) in zip(samples, scored, strict=True):
            sample.score, sample.acc = score, acc
        return stats

    def score_answers(
        self, answers: list[Answer]
    ) -> tuple[list[tuple[float, bool]], dict[str, float]]:
        """``[(score, acc)]`` per answer (same order) and the ``reward/*`` stats."""
        if not answers:
            return [], {"reward/n": 0.0}
        verdicts, stats = self.verify(answers)
        penalties = [self.penalty(a.length) for a in answers]
        scored = [
            ((1.0 if v.correct else -1.0) + p, bool(v.correct))
            for v, p in zip(verdicts, penalties, strict=True)
        ]
        n = float(len(answers))
        stats.update(
            {
                "reward/n": n,
                "reward/acc": sum(acc for _, acc in scored) / n,
                "reward/score_mean": sum(score for score, _ in scored) / n,
                "reward/no_answer_frac": sum(v.prediction is None for v in verdicts) / n,
                "reward/overlong_frac": sum(p < 0 for p in penalties) / n,
                "reward/overlong_penalty_mean": sum(penalties) / n,
            }
        )
        return scored, stats

    def start(self) -> None:
        """Start the scoring workers now (else the first :meth:`score` starts them)."""
        self.pool.start()

    def close(self) -> None:
        """Stop the scoring workers."""
        self.pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the settings only (e.g. into a Ray actor); workers restart on first use."""
        state = self.__dict__.copy()
        pool = self.pool
        state["pool"] = ScoringPool(
            pool.num_workers, pool.timeout_s, pool.kill_grace_s, pool.verifier
        )
        return state
