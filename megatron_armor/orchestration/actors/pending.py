"""Remote calls sent now and waited for later: the one convention of every queued call.

A Ray actor runs one caller's calls in the order sent, so the driver often sends a call and
reads its answer later (the step's log-probs behind which the updates are queued, the anchor
cache's counters read while the trainer works, a weight load behind an export). Every such
call is a :class:`Pending`: the refs, the ``CallKind`` its wait is bounded by
(``call_kinds.py``), and how its answers are read. :meth:`Pending.result` waits once,
through the run's call watch; the refs may also be handed to other calls as arguments (Ray
resolves them there, with no round trip through the driver).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from megatron_armor.orchestration.actors.call_kinds import CallKind
    from megatron_armor.orchestration.actors.call_watch import CallWatch

T = TypeVar("T")
_UNREAD = object()


def values(answers: list) -> list:
    """The answers as they came, one per ref."""
    return answers


class Pending(Generic[T]):
    """Calls sent without waiting (module docstring). ``read`` turns the answers (one per ref,
    in ``refs`` order) into the result; ``work`` scales the kind's deadline, ``timeout`` is a
    fixed bound instead. A call with no refs waits for nothing: its result is ``read([])``."""

    def __init__(self, watch: CallWatch, refs: list, kind: CallKind, what: str,
                 read: Callable[[list], T] = values, work: float = 1.0,
                 timeout: float | None = None):  # fmt: skip
        self.watch, self.refs, self.kind, self.what = watch, list(refs), kind, what
        self.read, self.work, self.timeout = read, work, timeout
        self._result: Any = _UNREAD

    @classmethod
    def ready(cls, value: T) -> Pending[T]:
        """A result in hand: nothing was sent."""
        done = cls(None, [], None, "", read=lambda _: value)
        done._result = value
        return done

    def result(self) -> T:
        """Wait for the answers (once; later calls return the same result) and read them."""
        if self._result is _UNREAD:
            answers = []
            if self.refs:
                answers = self.watch.get(self.refs, self.kind, self.what, self.timeout, self.work)
            self._result = self.read(answers)
        return self._result


def results(pending: list[Pending]) -> list:
    """The results of ``pending``, in order."""
    return [p.result() for p in pending]
