"""A process's sign of life for the driver's call deadlines (docs/orchestration.md, "Stuck calls").

Long work calls :func:`beat` as it moves (a decoded token, a trained micro-batch, a scored
sample; every actor call also beats when it starts and ends). The actor answers the driver's
``heartbeat`` call from a thread of its own with :func:`seconds_since_beat`, so the driver
tells a slow call that moves (recent beats: its deadline is extended) from one that is stuck
(no beat: the actor is named and killed). Plain module state: one writer thread, a float read.
"""

from __future__ import annotations

import time

_last_beat = time.monotonic()
_beats = 0
_busy = 0  # calls under way in this process


def beat() -> None:
    """Record progress now."""
    global _last_beat, _beats
    _last_beat = time.monotonic()
    _beats += 1


def seconds_since_beat() -> float:
    """Seconds since this process last called :func:`beat` (or since it imported this module)."""
    return time.monotonic() - _last_beat


def call_started() -> None:
    """A call begins (a beat too)."""
    global _busy
    _busy += 1
    beat()


def call_ended() -> None:
    global _busy
    _busy -= 1
    beat()


def busy() -> bool:
    """Whether a call is under way in this process (an idle actor whose next call waits for
    its arguments is not stuck itself)."""
    return _busy > 0


def beats() -> int:
    """How many times :func:`beat` was called in this process."""
    return _beats
