"""The kinds of the driver's waits on actors: each call site names its kind, and each kind
learns its own deadline (``call_watch.py``, docs/orchestration.md "Stuck calls"). A kind is
never derived from a call's description, a path or a run name.
"""

from __future__ import annotations

import enum


class CallKind(enum.Enum):
    """What a waited call does, named by its caller: each kind learns its own deadline. The
    kinds of the step's phases (``logged``) print their deadline when it is new or moved."""

    GENERATE = ("generate", True)
    """Policy or reference samples of a step (their scoring chained or not)."""
    VALIDATION = ("validation", True)
    """Validation's generation (``RemoteEngine``)."""
    SCORE = ("score", True)
    LOGPROBS = ("logprobs", True)
    UPDATES = ("updates", True)
    WEIGHT_PUSH = ("weight_push", True)
    """Weights moved into the engines: a push of any transport (with its update session), a
    load from disk, the weights of a replaced rollout worker."""
    RESET = ("reset", True)
    CHECKPOINT = ("checkpoint", True)
    """A trainer checkpoint written or read; the rollout workers' state read or loaded."""
    STARTUP = ("start-up", False)
    """An actor's start-up or model build (a fixed bound)."""
    CLOSE = ("close", False)
    """An actor's close (a fixed bound)."""
    PROFILER = ("profiler", False)
    COMPUTE_INTERVALS = ("compute intervals", False)
    TRAINER_OFFLOAD = ("trainer offload", False)
    MEMORY_HANDOFF = ("trainer memory hand-off", False)
    BEHAVIOR_SNAPSHOT = ("behavior weights", False)
    """The live weights kept as the next batch's behaviour weights (``async_rollout``)."""
    GPU_MEMORY = ("GPU memory", False)
    NODE_INFO = ("actor node info", False)
    HOST_MEMORY = ("host memory read", False)
    WEIGHT_VERSIONS = ("weight versions", False)
    """The versions the engines serve, recorded or read; the servers' addresses."""
    SENDER_RESET = ("weight-sync group reset", False)
    REFERENCE_VERSION = ("reference version", False)
    """A reference version recorded without weights sent."""
    REFERENCE_LOAD = ("reference load", False)
    """The trainer's reference weights into embedded engines (start-up, resume)."""
    REFERENCE_CACHE = ("reference cache", False)
    """A look-up in the anchor cache (cached verdicts, misses)."""
    REFERENCE_SCORES = ("reference scores", False)
    """The driver's scores of fresh cached anchors, kept by the workers."""
    REFERENCE_METRICS = ("reference metrics", False)
    RELEASE_MEMORY = ("release memory", False)
    RESUME_MEMORY = ("resume memory", False)
    SERVER_HEALTH = ("server health check", False)
    REJOIN = ("server rejoin", False)

    def __init__(self, label: str, logged: bool) -> None:
        self.label, self.logged = label, logged
