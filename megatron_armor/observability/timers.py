"""Per-phase wall-clock timers, and the step's time attributed phase by phase.

``with timers.phase("rollout"): ...`` adds the elapsed seconds to ``timing/rollout_s`` for
the current step; nested phases are timed independently (``rollout`` can contain
``generate`` and ``score``). Phases may run in several threads at once (the overlapped
reference parts of ``orchestration/step/anchor_rollout.py``): each adds its own seconds, so such a
phase can sum to more than the wall time it spanned. :meth:`PhaseTimers.pop_metrics` returns
the step's totals and clears them.

A timer that is one of the step's phases (``planner/step_phases.py``: ``score`` is
``reward``, ``sync`` is ``weight_sync``, ``generate`` names its own, ...) is also an NVTX range
of that phase's name and a phase of the :class:`PhaseClock`, which puts every second of the
step on the driver's thread in exactly one phase: the innermost one open, or ``driver``
(``phase/*``, docs/metrics.md). Those seconds sum to the step's wall time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_armor.observability.nvtx import nvtx_range
from megatron_armor.planner.step_phases import DRIVER, STEP_PHASES, step_phase

STEP_PHASE_OF_TIMER = {"score": "reward", "logprobs": "logprobs", "train": "train",
                       "sync": "weight_sync", "reset": "reset", "validate": "validate",
                       "checkpoint": "checkpoint"}  # fmt: skip
"""The step phase of a timer that always is one; ``generate`` says which (policy or
reference) at each call; ``rollout`` holds several and is none."""


class PhaseClock:
    """Attributes each second of one thread (the one that called :meth:`start`: the loop's)
    to exactly one step phase, the innermost open, else ``driver``. Phases opened in other
    threads (a rollout drawn beside the updates) do not count: they overlap the step."""

    def __init__(self) -> None:
        self._owner: int | None = None
        self._stack: list[str] = [DRIVER]
        self._seconds: dict[str, float] = defaultdict(float)
        self._since = time.perf_counter()

    def start(self) -> None:
        """A new step on this thread: every phase at zero, the clock in ``driver``."""
        self._owner = threading.get_ident()
        self._stack = [DRIVER]
        self._seconds.clear()
        self._since = time.perf_counter()

    def _switch(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self._seconds[self._stack[-1]] += now - self._since
        self._since = now

    @contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """The body's seconds go to phase ``name`` (a ``ValueError`` when it is none)."""
        step_phase(name)
        if threading.get_ident() != self._owner:
            yield
            return
        self._switch()
        self._stack.append(name)
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def metrics(self, now: float | None = None) -> dict[str, float]:
        """``phase/<key>_s`` of every phase so far this step (zeros included), up to ``now``
        (a ``time.perf_counter()`` reading; default: now), read from the owning thread; the
        clock keeps running."""
        self._switch(now)
        return {p.metric: self._seconds.get(p.name, 0.0) for p in STEP_PHASES}


class PhaseTimers:
    """Accumulate seconds per named phase within one training step; ``clock`` (shared by the
    timers of one run) attributes the step's seconds to its phases."""

    def __init__(self, clock: PhaseClock | None = None) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self.clock = clock or PhaseClock()

    @contextmanager
    def phase(self, name: str, step_phase_name: str | None = None) -> Iterator[None]:
        """Time the body as phase ``name``; when it is a step phase (``step_phase_name``, or
        :data:`STEP_PHASE_OF_TIMER`), also mark it as that NVTX range and clock it."""
        start = time.perf_counter()
        stage = step_phase_name or STEP_PHASE_OF_TIMER.get(name)
        try:
            with self.step_phase(stage) if stage else nvtx_range(name):
                yield
        finally:
            self.add(name, time.perf_counter() - start)

    @contextlib.contextmanager
    def step_phase(self, name: str) -> Iterator[None]:
        """The body as step phase ``name`` on the clock and an NVTX range, without a timer."""
        with nvtx_range(name), self.clock.inside(name):
            yield

    def add(self, name: str, seconds: float) -> None:
        """Add externally measured seconds to phase ``name`` (from any thread)."""
        with self._lock:
            self._seconds[name] += seconds

    def seconds(self, name: str) -> float:
        return self._seconds.get(name, 0.0)

    def pop_metrics(self) -> dict[str, float]:
        """``{"timing/<phase>_s": seconds}`` for the step so far; clears the totals."""
        with self._lock:
            out = {f"timing/{name}_s": value for name, value in sorted(self._seconds.items())}
            self._seconds.clear()
        return out
