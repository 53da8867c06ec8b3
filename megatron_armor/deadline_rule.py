"""The deadline rule of every watch: a deadline learned from the last durations of the same kind
of work (the driver's calls to its actors, ``orchestration/actors/call_watch.py``; the driver's
phases as its ``armor`` parent sees them, ``cli/driver_watch.py``).

Standard library only: the supervising parent reads it without importing torch or Ray.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

HISTORY = 20  # durations kept per kind


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between the two nearest ranks)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no values")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class DeadlineRule:
    """Per call kind: the deadline of a call given ``work`` units, learned from the kind's
    last :data:`HISTORY` durations per unit (``multiple`` x their ``q`` quantile x ``work``,
    within ``[floor_s, cap_s]``; ``cap_s`` before the kind's first call finished)."""

    multiple: float = 10.0
    q: float = 0.9
    floor_s: float = 30.0
    cap_s: float = 3600.0
    history: dict[Hashable, deque] = field(default_factory=dict)

    def deadline(self, kind: Hashable, work: float = 1.0) -> float:
        seen = self.history.get(kind)
        if not seen:
            return self.cap_s
        learned = self.multiple * quantile(seen, self.q) * max(work, 1e-9)
        return min(max(learned, self.floor_s), self.cap_s)

    def observe(self, kind: Hashable, seconds: float, work: float = 1.0) -> None:
        """A call of ``kind`` with ``work`` units took ``seconds``."""
        self.history.setdefault(kind, deque(maxlen=HISTORY)).append(seconds / max(work, 1e-9))
