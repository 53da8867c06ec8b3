"""In-process stand-ins for Ray, for unit tests of the driver's handles on real worker code.

- :class:`Remote` stands for a Ray actor handle: ``actor.method.remote(*args)`` runs the
  method of the wrapped object now, in this process, and its answer stands for the object ref
  (``.options(num_returns=k)`` returns the same call: the answer is the tuple itself).
- :class:`InstantWatch` stands for the run's ``CallWatch``: ``get`` returns the answers at
  once and records each wait's kind and description.

They cannot show what needs Ray: calls running in other processes and in the order each
caller sent them, object refs handed between actors, pickling, deadlines, a dead or stuck
actor (the e2e tier runs those).
"""

from __future__ import annotations

from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.rollout_fleet import RolloutFleet


class Remote:
    """``actor.method.remote(*args)`` runs ``method`` now; the value stands in for its ref."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)
        call = type("Method", (), {"remote": staticmethod(method)})
        call.options = staticmethod(lambda **options: call)  # num_returns: the tuple itself
        return call


class InstantWatch:
    """A call watch whose waits return the answers at once; ``waits`` records ``(kind,
    what)`` of each."""

    def __init__(self) -> None:
        self.waits: list[tuple[CallKind, str]] = []

    def get(self, refs, kind: CallKind, what: str, timeout=None, work: float = 1.0):
        if not isinstance(kind, CallKind):
            raise TypeError(f"the kind of {what!r} must be a CallKind, not {kind!r}")
        self.waits.append((kind, what))
        return list(refs) if isinstance(refs, list | tuple) else refs

    def cap(self) -> float:
        return 3600.0


def local_fleet(workers: list, policy: list[int] | None = None,
                reference: list[int] | None = None, has_ref_pool: bool = False,
                watch: InstantWatch | None = None) -> RolloutFleet:  # fmt: skip
    """A :class:`RolloutFleet` over ``workers`` (objects with the worker's methods) called in
    process; every worker in both roles unless ``policy`` / ``reference`` say otherwise."""
    everyone = list(range(len(workers)))
    return RolloutFleet(watch or InstantWatch(), [Remote(w) for w in workers],
                        everyone if policy is None else policy,
                        everyone if reference is None else reference, has_ref_pool)  # fmt: skip
