"""Per-phase wall-clock timers, each phase also an NVTX range for Nsight Systems.

``with timers.phase("rollout"): ...`` adds the elapsed seconds to ``timing/rollout_s`` for
the current step; nested phases are timed independently (``rollout`` can contain
``generate`` and ``score``). Phases may run in several threads at once (the overlapped
reference parts of ``orchestration/step/anchor_rollout.py``): each adds its own seconds, so such a
phase can sum to more than the wall time it spanned. :meth:`PhaseTimers.pop_metrics` returns
the step's totals and clears them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_armor.observability.nvtx import nvtx_range

# Timer phase -> NVTX range name where they differ (observability.nvtx.PHASE_RANGES).
NVTX_NAMES = {"sync": "weight_sync", "score": "reward"}


class PhaseTimers:
    """Accumulate seconds per named phase within one training step."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` (and mark it as an NVTX range)."""
        start = time.perf_counter()
        try:
            with nvtx_range(NVTX_NAMES.get(name, name)):
                yield
        finally:
            self.add(name, time.perf_counter() - start)

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
