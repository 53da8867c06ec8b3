"""Faults of a run's Ray actors: which actor a failure came from, the bound on in-run
recoveries, and the errors that end a run that cannot recover in place.

A *fault* is a failure of the machinery, not of the run's code or data: an actor process
that died (``kill -9``, the OOM killer, a lost node), an object lost with its node, a call
past its deadline whose actor made no progress (``call_watch.StuckCallError``: the actor is
killed first). An exception raised by an actor's own code (a
``RayTaskError`` whose cause is not one of those) is not a fault: it propagates unchanged.
:func:`locate` names the actor a fault came from; ``orchestration/actors/recovery.py`` replaces a
dead rollout or reward worker in the run, and everything else (a trainer rank, a worker of
SGLang servers, a state lost with its worker) ends the run with :class:`RequeueError`:
exit 75, so ``slurm/armor.sbatch`` requeues it and ``--resume auto`` continues from the
newest complete checkpoint. :class:`RecoveryBudget` bounds the replacements
(``run.max_recoveries`` within ``run.recovery_window`` steps); past it the run stops with
:class:`RecoveryLimitError` (exit :data:`EXIT_RECOVERY_LIMIT`, not requeued: workers that keep
dying would die again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

from megatron_armor.orchestration.run import checkpoints
from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE

EXIT_RECOVERY_LIMIT = 69  # EX_UNAVAILABLE
ACTOR_CLASSES = {"trainer": "TrainerWorker", "rollout": "RolloutWorker", "reward": "RewardWorker"}


class RequeueError(RuntimeError):
    """A fault the run cannot recover from in place: the driver exits 75 (requeue)."""


class RecoveryLimitError(RuntimeError):
    """More recoveries than ``run.max_recoveries`` within ``run.recovery_window`` steps."""


def _ray_faults() -> tuple[type, ...]:
    import ray.exceptions as rex

    return (rex.RayActorError, rex.ObjectLostError, rex.NodeDiedError, rex.RaySystemError,
            rex.LocalRayletDiedError, rex.WorkerCrashedError, rex.OutOfMemoryError)  # fmt: skip


def ray_fault(err: BaseException) -> BaseException | None:
    """The fault inside ``err`` (itself, a Ray task's cause, or what it was raised from):
    a dead actor (not one whose ``__init__`` raised), a lost object or node, a bounded wait
    that ran out (``TimeoutError``); ``None`` for an error of the run's own code."""
    faults, seen = _ray_faults(), err
    for _ in range(16):  # cause chains are short; never loop on a cycle
        if seen is None:
            return None
        if isinstance(seen, faults) and not getattr(seen, "actor_init_failed", False):
            return seen
        if isinstance(seen, TimeoutError):
            return seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None


@dataclass(frozen=True)
class Fault:
    """A fault and the actor it came from (``kind`` ``unknown`` and index -1: none known)."""

    kind: str
    index: int
    error: BaseException

    @property
    def actor(self) -> str:
        """``RolloutWorker 0``, ``TrainerWorker 1`` or ``an actor``."""
        if self.kind not in ACTOR_CLASSES:
            return "a Ray process"
        return f"{ACTOR_CLASSES[self.kind]} {self.index}"

    def summary(self) -> str:
        """``ActorDiedError: <first line>`` of the fault."""
        lines = str(self.error).strip().splitlines()
        first = lines[0] if lines else ""
        return f"{type(self.error).__name__}: {first}".rstrip(": ")


def locate(err: BaseException, handles: dict[str, object]) -> Fault | None:
    """The :class:`Fault` in ``err``, with the actor of ``handles`` (``{kind: handle with
    .actors}``) whose id it names; ``None`` when ``err`` is no fault."""
    fault = ray_fault(err)
    if fault is None:
        return None
    actor_id = getattr(fault, "actor_id", None)
    for kind, handle in handles.items():
        for index, actor in enumerate(getattr(handle, "actors", [])):
            if actor_id is not None and actor._actor_id.hex() == actor_id:
                return Fault(kind, index, fault)
    return Fault("unknown", -1, fault)


def newest_checkpoint_text(run_dir: str | Path) -> str:
    """``step 2 (PATH)`` of the newest complete checkpoint, or what a requeue does without."""
    newest = checkpoints.list_checkpoints(run_dir)
    if not newest:
        return "none yet (a requeue starts the run over)"
    step, path = newest[-1]
    return f"step {step} ({path})"


def requeue_error(run_dir: str | Path, fault: Fault, step: int, why: str) -> RequeueError:
    """The message of a run that stops for a requeue: the fault, why it cannot be recovered in
    the run, the newest complete checkpoint and how to continue."""
    return RequeueError(
        f"fault at step {step}: {fault.actor} failed ({fault.summary()}); {why}: exiting "
        f"{EXIT_REQUEUE} for a requeue. Newest complete checkpoint: "
        f"{newest_checkpoint_text(run_dir)}; `armor train CONFIG --resume auto` continues from "
        f"it (slurm/armor.sbatch requeues the job on exit {EXIT_REQUEUE})"
    )


class RecoveryBudget:
    """At most ``limit`` recoveries within any ``window`` consecutive steps."""

    def __init__(self, limit: int, window: int) -> None:
        self.limit, self.window = limit, window
        self.events: deque[tuple[int, str]] = deque()

    def spend(self, step: int, fault: Fault, run_dir: str | Path) -> int:
        """Count a recovery at ``step``; returns how many the window holds now, or raises
        :class:`RecoveryLimitError` when it would be one more than ``limit``."""
        while self.events and self.events[0][0] <= step - self.window:
            self.events.popleft()
        if len(self.events) >= self.limit:
            raise self.limit_error(step, fault, run_dir)
        self.events.append((step, fault.actor))
        return len(self.events)

    def limit_error(self, step: int, fault: Fault, run_dir: str | Path) -> RecoveryLimitError:
        earlier = ", ".join(f"{actor} at step {s}" for s, actor in self.events) or "none"
        return RecoveryLimitError(
            f"{fault.actor} failed at step {step} ({fault.summary()}) after {len(self.events)} "
            f"recoveries within {self.window} steps (run.max_recoveries={self.limit}, "
            f"run.recovery_window={self.window}; earlier: {earlier}): the workers keep dying; "
            "look for the cause (the OOM killer in dmesg, the workers' logs under Ray's "
            f"session directory), then `armor train CONFIG --resume auto` continues from "
            f"{newest_checkpoint_text(run_dir)}"
        )
