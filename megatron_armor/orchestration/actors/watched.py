"""The actor side of the call watch (``call_watch.py``): every worker class answers a
heartbeat from a concurrency group of its own, and every public method beats when it starts and
ends (``heartbeat.py``).
"""

from __future__ import annotations

from megatron_armor.heartbeat import (
    busy,
    call_ended,
    call_started,
    seconds_since_beat,
)

WATCH_GROUP = "watch"
CONCURRENCY_GROUPS = {WATCH_GROUP: 1}


class Watched:
    """The heartbeat of a worker class (the driver's ``CallWatch`` asks it past a deadline). Its
    actors are made with ``call_watch.start_actor``: Ray refuses an actor class whose method names a
    concurrency group the actor was not given."""

    def heartbeat(self) -> tuple[bool, float]:
        """Whether a call is under way here, and the seconds since this process last made
        progress."""
        return busy(), seconds_since_beat()

    # what ray.method(concurrency_group=...) sets, without importing Ray here
    heartbeat.__ray_concurrency_group__ = WATCH_GROUP


def beating(cls):
    """Class decorator: every public method of ``cls``, its own and those of its bases but
    :class:`Watched`'s, beats when it starts and when it ends (a queue of short calls is
    progress too); methods of the :data:`WATCH_GROUP` are left as they are."""
    import functools
    import inspect

    def wrap(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            call_started()
            try:
                return method(*args, **kwargs)
            finally:
                call_ended()

        call.__beats__ = True
        return call

    for base in reversed(cls.__mro__[:-1]):  # the nearest definition wins
        if base is Watched:
            continue
        for name, value in vars(base).items():
            skip = getattr(value, "__ray_concurrency_group__", None) == WATCH_GROUP
            skip |= getattr(value, "__beats__", False)  # wrapped already
            found = inspect.getattr_static(cls, name) is value  # not overridden below
            if inspect.isfunction(value) and not name.startswith("_") and not skip and found:
                setattr(cls, name, wrap(value))
    return cls
