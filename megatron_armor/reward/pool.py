"""A process pool that verifies answers with a per-item time limit.

Why processes: math-verify relies on ``signal.alarm`` (main thread only), and a
pathological answer such as ``9^{9^{9^{9^9}}}`` can sit in one C call (big-integer power)
that holds the interpreter lock, so no in-process timeout can stop it.

How an item is bounded (``timeout_s`` per item):

1. Inside the worker, an interval timer (``setitimer``) interrupts Python-level work after
   ``timeout_s``; the item is reported as ``timeout`` and the worker goes on.
2. The parent watches every worker; a worker that reports nothing for
   ``timeout_s + kill_grace_s`` is killed (SIGKILL), its current item (the worker writes
   its index to shared memory before each item) is a ``timeout``, the rest of its chunk
   that the parent has no verdict for goes back to the queue, and a fresh worker replaces
   it. A worker sends its verdicts in batches (:data:`REPORT_EVERY_S`), not one message per
   answer, so fast verifiers are not slowed down by the messages.

So one bad answer costs at most ``timeout_s + kill_grace_s`` of one worker and never
stalls the batch. A worker that dies (e.g. out of memory) marks its item ``error``.
Workers are ``spawn``-ed (safe next to torch / Ray threads) and stay up across batches.

Every replacement is counted (``reward/worker_restarts`` of the next batch), also of a worker
that died between batches. A worker that dies before it is ready is started again after a
back-off (:data:`START_BACKOFF_S`, doubling); :data:`START_ATTEMPTS` such deaths in a row stop
the pool with an error naming the verifier and the last exit code.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

WORKER_START_TIMEOUT_S = 120.0
START_ATTEMPTS = 5
"""Workers that die while starting, in a row, before the pool gives up (a verifier that cannot
import, or a node out of memory: starting more would fail the same way)."""
START_BACKOFF_S = 0.1
"""Wait before the first restart of a worker that died while starting; doubled each time in a
row (0.1, 0.2, 0.4, 0.8 s before the fifth and last attempt)."""
REPORT_EVERY_S = 0.01
"""A worker sends the verdicts it holds before starting an item once its last send is this
old (and at the end of a chunk): a few messages per chunk instead of one per answer, and a
deadline of ``timeout_s + kill_grace_s`` after the last send still leaves a slow item its
whole ``timeout_s`` (``kill_grace_s`` is far longer)."""
MAX_CHUNK = 64
"""Most jobs per chunk. A worker takes its next chunk only after answering the last, so each
chunk costs a round trip through both processes (a few ms on a loaded machine): with fast
verifiers (the DAPO rule: ~5 us an answer) that round trip, not the verifying, is the time."""


@dataclass(frozen=True)
class Job:
    """One answer to verify."""

    verifier: str
    response: str
    ground_truth: str


@dataclass(frozen=True)
class Verdict:
    """Outcome of one job; ``status`` is ``ok`` | ``timeout`` | ``error``."""

    correct: bool
    prediction: str | None
    status: str = "ok"


@dataclass
class PoolStats:
    """Counts of one :meth:`ScoringPool.run`."""

    timeouts: int = 0
    errors: int = 0
    worker_restarts: int = 0
    seconds: float = 0.0


class RewardPoolError(RuntimeError):
    """The scoring pool cannot keep its workers up; the message names ``reward.verifier``, the
    last exit code and what to check."""


class _ItemTimeout(BaseException):
    """Raised by the worker's timer; a BaseException so verifier ``except Exception`` misses it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _ItemTimeout()


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when the parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        except OSError:  # not glibc: the pipe's EOF still ends an idle worker
            pass


def verify_job(job: Job) -> Verdict:
    """Run one job's verifier (no time limit; callers bound it)."""
    from megatron_armor.reward.verifiers import VERIFIERS

    result = VERIFIERS[job.verifier](job.response, job.ground_truth)
    return Verdict(result.correct, result.prediction)


def _error(e: Exception) -> Verdict:
    return Verdict(False, f"{type(e).__name__}: {e}"[:200], "error")


def verify_inline(job: Job) -> Verdict:
    """:func:`verify_job` in the calling process, without a time limit (for verifiers whose
    cost is bounded, ``reward/scorer.INLINE_VERIFIERS``); exceptions become ``error`` verdicts."""
    try:
        return verify_job(job)
    except Exception as e:  # a verifier bug must not kill the batch; report it
        return _error(e)


def _verify_bounded(job: Job, timeout_s: float) -> Verdict:
    """:func:`verify_job` under an interval timer; exceptions become ``error`` verdicts."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return verify_job(job)
    except _ItemTimeout:
        return Verdict(False, None, "timeout")
    except Exception as e:  # a verifier bug must not kill the batch; report it
        return _error(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _answer_chunk(
    conn: Connection, chunk_id: int, jobs: list[Job], timeout_s: float, current
) -> None:
    """Verify ``jobs`` in order, writing the index of the item under way to the shared
    ``current`` (what the parent reads if it must kill this process); send the verdicts as
    ``(chunk_id, first index, [verdict, ...])``: at the end, and before an item once the last
    send is :data:`REPORT_EVERY_S` old, so the parent's view of the progress is never later
    than that."""
    unsent: list[Verdict] = []
    first, last_send = 0, time.monotonic()
    for i, job in enumerate(jobs):
        if unsent and time.monotonic() - last_send >= REPORT_EVERY_S:
            conn.send((chunk_id, first, unsent))
            first, unsent, last_send = i, [], time.monotonic()
        current.value = i
        unsent.append(_verify_bounded(job, timeout_s))
    conn.send((chunk_id, first, unsent))


def _worker_main(conn: Connection, timeout_s: float, current) -> None:
    """Worker loop: receive ``(chunk_id, jobs)``, answer them (:func:`_answer_chunk`)."""
    _die_with_parent()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from megatron_armor.reward.math_verify_rule import quiet_math_verify

    quiet_math_verify()
    verify_job(Job("math_verify", "Answer: 1", "1"))  # warm the imports and parser caches
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        _answer_chunk(conn, *message, timeout_s, current)


@dataclass
class _Worker:
    """Parent-side handle of one worker process."""

    process: Any
    conn: Connection
    current: Any  # shared int: index in the chunk of the item the worker is verifying
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)
    chunk_id: int = -1
    chunk: list[int] = field(default_factory=list)  # job indices of the chunk in flight
    done: int = 0  # items of the chunk answered so far (received by the parent)
    last_progress: float = 0.0

    @property
    def busy(self) -> bool:
        return self.done < len(self.chunk)


class ScoringPool:
    """``num_workers`` verifier processes with a per-item limit of ``timeout_s`` seconds."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        kill_grace_s: float = 0.5,
        verifier: str = "math_verify",
    ):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers}: must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={timeout_s}: must be > 0 seconds")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.verifier = verifier  # ``reward.verifier``, named when workers cannot start
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._next_chunk = 0
        self._restarts = 0  # replacements not yet reported in a batch's stats
        self._start_deaths = 0  # workers in a row that died before they were ready
        self._spawn_at = 0.0  # monotonic time before which no worker is started (back-off)

    # -- worker lifecycle -------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        current = self._ctx.Value("i", 0, lock=False)
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.timeout_s, current), daemon=True,
            name="armor-reward",
        )  # fmt: skip
        process.start()
        child.close()
        return _Worker(process, parent, current)

    def _ensure_workers(self) -> None:
        """Replace dead workers (counted: one that died while idle between batches too, one
        that died while starting as a start failure) and start missing ones, unless a
        back-off holds the start (:meth:`_start_died`)."""
        for worker in [w for w in self._workers if not w.process.is_alive()]:
            self._kill(worker)
            if worker.ready:
                self._restarts += 1
            else:
                self._start_died(worker.process.exitcode)
        if time.monotonic() < self._spawn_at:
            return
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _start_died(self, exitcode: int | None) -> None:
        """A worker died before it was ready: back off before the next start; after
        :data:`START_ATTEMPTS` in a row, give up naming the verifier and the exit code."""
        self._restarts += 1
        self._start_deaths += 1
        if self._start_deaths >= START_ATTEMPTS:
            raise RewardPoolError(
                f"reward.verifier={self.verifier!r}: a reward worker exited while starting "
                f"{self._start_deaths} times in a row (last exit code {describe_exit(exitcode)}); "
                "check that the verifier imports in a fresh Python process (python -c 'import "
                f"math_verify') and that the node has memory for reward.num_workers="
                f"{self.num_workers} more processes"
            )
        self._spawn_at = time.monotonic() + START_BACKOFF_S * 2 ** (self._start_deaths - 1)

    def start(self) -> None:
        """Start the workers and wait until each is ready (``run`` also starts them lazily)."""
        self._ensure_workers()
        stats = PoolStats()
        while len(self._workers) < self.num_workers or not all(w.ready for w in self._workers):
            self._collect([], deque(), stats)
            self._enforce_deadlines([], deque(), stats)
            self._ensure_workers()

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._workers.remove(worker)

    def _terminate(self) -> None:
        for worker in list(self._workers):
            self._kill(worker)

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=2.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5.0)
            worker.conn.close()
        self._workers = []

    # -- scheduling -------------------------------------------------------------------------

    def run(self, jobs: list[Job]) -> tuple[list[Verdict], PoolStats]:
        """Verify ``jobs``; verdicts come back in job order."""
        start = time.monotonic()
        stats = PoolStats()
        verdicts: list[Verdict | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        chunk_size = self.chunk_size(len(jobs))
        try:
            self._ensure_workers()
            while pending or any(w.busy for w in self._workers):
                self._dispatch(jobs, pending, chunk_size)
                self._collect(verdicts, pending, stats)
                self._enforce_deadlines(verdicts, pending, stats)
                self._ensure_workers()
        except BaseException:
            # Interrupted mid-batch: workers may still hold chunks of this batch; start over.
            self._terminate()
            raise
        stats.worker_restarts, self._restarts = self._restarts, 0
        stats.seconds = time.monotonic() - start
        return [v for v in verdicts if v is not None], stats

    def chunk_size(self, jobs: int) -> int:
        """Jobs per chunk: a quarter of a worker's share, so the workers stay balanced when
        answers differ in cost; all of it (up to :data:`MAX_CHUNK`) for a single worker,
        which has nobody to balance with and would only pay more round trips."""
        splits = 4 * self.num_workers if self.num_workers > 1 else 1
        return max(1, min(MAX_CHUNK, math.ceil(jobs / splits)))

    def _dispatch(self, jobs: list[Job], pending: deque[int], chunk_size: int) -> None:
        """Give a chunk to every ready, idle worker."""
        for worker in self._workers:
            if worker.ready and not worker.busy and pending:
                chunk = [pending.popleft() for _ in range(min(chunk_size, len(pending)))]
                self._next_chunk += 1
                worker.chunk_id, worker.chunk, worker.done = self._next_chunk, chunk, 0
                worker.current.value = 0
                worker.last_progress = time.monotonic()
                worker.conn.send((worker.chunk_id, [jobs[i] for i in chunk]))

    def _wait_timeout(self) -> float:
        """Seconds until the nearest deadline (busy item, worker start-up, a start held back)."""
        now, deadlines = time.monotonic(), []
        if len(self._workers) < self.num_workers:
            deadlines.append(self._spawn_at)
        for w in self._workers:
            if not w.ready:
                deadlines.append(w.started_at + WORKER_START_TIMEOUT_S)
            elif w.busy:
                deadlines.append(w.last_progress + self.timeout_s + self.kill_grace_s)
        return max(0.0, min(deadlines, default=now + 1.0) - now)

    def _collect(
        self, verdicts: list[Verdict | None], pending: deque[int], stats: PoolStats
    ) -> None:
        """Receive whatever the workers have sent, waiting until the nearest deadline."""
        by_conn = {w.conn: w for w in self._workers}
        for conn in wait(list(by_conn), timeout=self._wait_timeout()):
            worker = by_conn[conn]
            try:
                while conn.poll():
                    self._receive(worker, conn.recv(), verdicts, stats)
            except (EOFError, OSError):
                self._replace_dead(worker, verdicts, pending, stats)

    def _receive(
        self, worker: _Worker, message: tuple, verdicts: list[Verdict | None], stats: PoolStats
    ) -> None:
        if message[0] == "ready":
            worker.ready = True
            self._start_deaths = 0
            return
        chunk_id, first, answered = message
        if chunk_id != worker.chunk_id:
            return
        for i, verdict in enumerate(answered, start=first):
            verdicts[worker.chunk[i]] = verdict
            stats.timeouts += verdict.status == "timeout"
            stats.errors += verdict.status == "error"
        worker.done = first + len(answered)
        worker.last_progress = time.monotonic()

    def _abandon(
        self, worker: _Worker, verdict: Verdict, verdicts: list[Verdict | None], pending: deque[int]
    ) -> None:
        """Give the item the worker was verifying ``verdict`` and requeue the rest of its
        chunk that the parent has no verdict for (answers it had not sent yet included)."""
        if worker.busy:
            stuck = max(worker.done, min(worker.current.value, len(worker.chunk) - 1))
            verdicts[worker.chunk[stuck]] = verdict
            unanswered = worker.chunk[worker.done : stuck] + worker.chunk[stuck + 1 :]
            pending.extendleft(reversed(unanswered))
        self._kill(worker)
        self._workers.append(self._spawn())

    def _replace_dead(
        self, worker: _Worker, verdicts: list[Verdict | None], pending: deque[int], stats: PoolStats
    ) -> None:
        """A worker whose pipe closed: its item is an ``error`` and it is replaced; one that
        was still starting is started again after a back-off (:meth:`_start_died`)."""
        if not worker.ready:
            self._kill(worker)  # reaps it: its exit code is known
            self._start_died(worker.process.exitcode)
            return
        stats.errors += worker.busy
        self._restarts += 1
        self._abandon(worker, Verdict(False, None, "error"), verdicts, pending)

    def _enforce_deadlines(
        self, verdicts: list[Verdict | None], pending: deque[int], stats: PoolStats
    ) -> None:
        """Kill workers stuck past the item limit (or that never start) and replace them."""
        now = time.monotonic()
        for worker in list(self._workers):
            if not worker.ready and now > worker.started_at + WORKER_START_TIMEOUT_S:
                raise RuntimeError(
                    f"a reward worker did not start within {WORKER_START_TIMEOUT_S:.0f} s; "
                    "check that math-verify imports in a fresh Python process"
                )
            if worker.busy and now > worker.last_progress + self.timeout_s + self.kill_grace_s:
                stats.timeouts += 1
                self._restarts += 1
                self._abandon(worker, Verdict(False, None, "timeout"), verdicts, pending)


def describe_exit(exitcode: int | None) -> str:
    """``-9 (killed by SIGKILL)``, ``1``, or ``unknown`` for a process's exit code."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        return f"{exitcode} (killed by {signal.Signals(-exitcode).name})"
    return str(exitcode)
