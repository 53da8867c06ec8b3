"""In-run recovery of a dead rollout or reward worker (docs/orchestration.md, "Faults"); a
stuck one is killed past its call deadline (``call_watch.py``) and recovered the same way.

The loop runs the parts of a step that call the rollout and reward workers through
:meth:`Recovery.guard`. When a call fails with a fault (``faults.py``) of one of those workers,
the worker is replaced by a new actor made like the first (same options, same bundle), the
rollout workers get back the state of the step's start, the new one gets the trainer's current
weights, and the part is done again:

===========  ==============================================  ================================
phase        the fault came during                           then
===========  ==============================================  ================================
rollout      the step's generation and scoring               the driver's sampler and RNG go
                                                             back to the step's start and the
                                                             rollout is drawn again
sync/reset   the weight push (after the step's updates)      the push is sent again
validation   validation                                      validation runs again
checkpoint   the read of the rollout workers' state          the read runs again
===========  ==============================================  ================================

The trainer is never touched twice: its updates come between the rollout and the sync, and
nothing of the trainer is redone. The state a replacement needs is the anchor cache
(``algo.anchor_source: cache``), the only state a rollout worker holds besides its weights:
the driver reads it after each step's rollout, before the trainer gets the step
(:meth:`collect`; one call per worker, the cache as tensors, as a checkpoint stores it), and
the replaced and surviving workers load it (a reset since then drops it, as the reset did).
The anchor cache and the reference call sent ahead (``rollout.prefetch_reference``) never go
together (``anchor_rollout.prefetches_reference``). Without the cache there is nothing to
restore, and the next step's reference call sent during the step (``rollout.prefetch_
reference``) is drawn again with the same seed. Every sample drawn again is the one the
uninterrupted run drew: the seeds derive from ``(run.seed, step, batch)``
(``anchor_rollout.derive_seed``).

What cannot be rebuilt in the run ends it for a requeue (``faults.RequeueError``, exit 75):
a trainer rank, a worker that owns SGLang servers, a fault of a process the run does not
know, and a cache state lost with its worker. ``run.max_recoveries`` bounds the replacements
within ``run.recovery_window`` steps (``faults.RecoveryBudget``). Each recovery is a line on
the console and in ``RUN_DIR/recoveries.jsonl``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megatron_armor.orchestration.actors.actor_handles import kill_run_processes
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.call_watch import (
    CallWatch,
    StuckCallError,
    StuckServerError,
    start_actor,
)
from megatron_armor.orchestration.actors.faults import Fault, RecoveryBudget, locate, requeue_error
from megatron_armor.orchestration.actors.pending import Pending
from megatron_armor.rollout.backends import backend_of

if TYPE_CHECKING:
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.data.sampler import ResumableSampler
    from megatron_armor.orchestration.actors.actor_handles import RewardActors, TrainerActors
    from megatron_armor.orchestration.actors.rollout_fleet import RolloutSide
    from megatron_armor.orchestration.actors.weight_sync import WeightSync
    from megatron_armor.orchestration.run.host_usage import HostMemory
    from megatron_armor.orchestration.run.run_state import RunState

RECOVERIES_FILE = "recoveries.jsonl"
WHY_TRAINER = "a trainer rank's model and optimizer state live only in its process"
AFTER_ROLLOUT = ("sync", "reset", "validation", "checkpoint")
"""Phases after the step's rollout: the rollout workers' state is that of the step's end."""


class RunParts(Protocol):
    """What recovery reads and replaces of a running session (``orchestration/run/session.py``
    passes its ``Session``): the config and run directory, the driver's sampler and run state,
    the actor handles, the weight sync, the host-memory watch, the call watch and the
    session's :class:`Recovery`."""

    config: ArmorConfig
    run_dir: Path
    sampler: ResumableSampler
    state: RunState
    trainer: TrainerActors
    rollout: RolloutSide
    reward: RewardActors
    weight_sync: WeightSync
    host_memory: HostMemory
    call_watch: CallWatch
    recovery: Recovery


@dataclass
class StepMark:
    """The driver's state at the start of a step's rollout: what a redrawn rollout starts
    from (the sampler position and the driver's RNG)."""

    sampler: dict
    python_rng: Any
    torch_rng: torch.Tensor

    @classmethod
    def take(cls, sampler) -> StepMark:
        return cls(sampler.state_dict(), random.getstate(), torch.get_rng_state())

    def rewind(self, sampler) -> None:
        sampler.load_state_dict(self.sampler)
        random.setstate(self.python_rng)
        torch.set_rng_state(self.torch_rng)


UNSERVED = (
    "the engines serve weights the trainer no longer holds (orchestration.async_rollout="
    "bounded draws the next window beside the updates without a copy of them)"
)
"""Why a rollout worker or server that fails while a bounded window is drawn is not replaced
in the run: exit 75, and the resume redraws the window exactly."""


class Recovery:
    """Replacing dead rollout and reward workers in the run; one per session."""

    def __init__(self, config) -> None:
        run = config.run
        self.budget = RecoveryBudget(run.max_recoveries, run.recovery_window)
        self.snapshot: list[dict] | None = None  # the reference workers' states (anchor cache)
        self.snapshot_step = -1  # the step whose end (or resumed start) they are of
        self.step = 0  # the step under way, for faults the loop does not guard
        self.anchor_rollout = None  # the loop's AnchorRollout (its sent-ahead call is dropped)
        self.served: str | None = "policy"
        """The trainer weights a replacement gets (:meth:`serve`): ``None`` while a bounded
        window is drawn (kept nowhere: :data:`UNSERVED`)."""
        self.servers_restarted = 0  # SGLang servers restarted after a stuck call, not yet counted

    def serve(self, weights: str | None) -> None:
        """The trainer weights the engines serve from now on, which a replacement gets:
        ``behavior`` while the next step is drawn beside the updates, else ``policy``
        (``orchestration/step/async_rollout.py``); ``None`` while a bounded window is drawn
        (the weights are kept nowhere: a rollout fault is a requeue, :data:`UNSERVED`)."""
        self.served = weights

    # ------------------------------------------------------------------ snapshots
    def submit_snapshot(self, s: RunParts) -> Pending[list[dict] | None]:
        """Read the rollout workers' state right after a step's rollout (the anchor cache
        only; nothing to read without it), sent now."""
        if not s.rollout.reference.caches_anchors:
            return Pending.ready(None)
        return s.rollout.reference.submit_state("rollout state (kept for a recovery)")

    def settle_snapshot(self, pending: Pending[list[dict] | None], step: int) -> None:
        """Wait for :meth:`submit_snapshot`'s read: the state a replacement continues from
        (that after step ``step``'s rollout)."""
        self.snapshot, self.snapshot_step = pending.result(), step

    # ------------------------------------------------------------------ guarded calls
    def collect(self, s: RunParts, rollout, step: int):
        """``(result, counters)``: the step's rollout (``rollout.collect``), the queued read of
        the anchor-cache counters (``ReferenceDraws.submit_metrics``) and the rollout
        workers' state after it (:meth:`submit_snapshot`, waited for: each worker answers the
        read before it), drawn again after a recovery from the driver's state of the step's
        start. Both are in hand before the trainer gets the step: a fault after this point
        never needs the rollout drawn again."""
        self.step, self.anchor_rollout = step, rollout
        mark = StepMark.take(s.sampler)

        def draw():
            result = rollout.collect(step)
            counters = s.rollout.reference.submit_metrics()  # ahead of the state on each worker
            self.settle_snapshot(self.submit_snapshot(s), step)  # the state after it
            return result, counters

        return self.guard(s, step, "rollout", draw, redo=lambda: mark.rewind(s.sampler))

    def guard(self, s: RunParts, step: int, phase: str, call: Callable, redo=None):
        """``call()``; after a fault of a rollout or reward worker, :meth:`recover` and call
        it again (``redo()`` first); any other failure propagates."""
        while True:
            try:
                return call()
            except StuckServerError as err:
                self.heal_servers(s, step, phase, err)
                if redo is not None:
                    redo()
            except Exception as err:
                fault = locate(err, handles(s))
                if fault is None:
                    raise
                self.recover(s, step, phase, fault, err)
                if redo is not None:
                    redo()

    def recover(self, s: RunParts, step: int, phase: str, fault: Fault, err: BaseException) -> None:
        """Replace the worker of ``fault`` and restore the rollout workers for ``phase`` of
        ``step``, or raise :class:`~megatron_armor.orchestration.actors.faults.RequeueError`."""
        why = self.unrecoverable(s, step, phase, fault)
        if why:
            raise requeue_error(s.run_dir, fault, step, why) from err
        count = self.budget.spend(step, fault, s.run_dir)
        new = replace_actor(s, fault)
        self.restore_rollout(s, new, everyone=fault.kind == "rollout" or phase == "rollout")
        if self.anchor_rollout is not None:
            self.anchor_rollout.forget_prefetch()
        s.rollout.reference.forget_unsettled()
        record(s, step, phase, fault, count, self.budget)

    def heal_servers(self, s: RunParts, step: int, phase: str, err: StuckServerError) -> None:
        """The SGLang servers of ``err`` (killed past a call deadline) restarted with their
        pool's current weights (``ServerHealth.heal``, as a dead server is), counted in
        ``run.max_recoveries``; the caller does the phase again."""
        fault = locate(err, handles(s)) or Fault("unknown", -1, err)
        redrawn = phase not in AFTER_ROLLOUT
        why = ""
        if s.config.run.max_recoveries == 0:
            why = "run.max_recoveries=0 (nothing is restarted in the run)"
        elif self.served is None:
            why = UNSERVED
        elif s.rollout.reference.caches_anchors and redrawn and self.snapshot_step != step - 1:
            why = f"the rollout workers' anchor cache of step {step - 1} is not in the driver"
        if why:
            raise requeue_error(s.run_dir, fault, step, why) from err
        count = self.budget.spend(step, fault, s.run_dir)
        err.settle()  # the calls on the killed servers end first
        self.servers_restarted += s.rollout.health.heal()
        if self.snapshot is not None:  # the anchor cache as the phase found it
            self.restore_rollout(s, None, everyone=redrawn)
        if self.anchor_rollout is not None:
            self.anchor_rollout.forget_prefetch()
        s.rollout.reference.forget_unsettled()
        servers = ", ".join(x["url"] for x in err.servers)
        record(s, step, phase, fault, count, self.budget, what=f"SGLang server {servers}")

    def pop_servers_restarted(self) -> int:
        """SGLang servers restarted by :meth:`heal_servers` since the last call."""
        out, self.servers_restarted = self.servers_restarted, 0
        return out

    def unrecoverable(self, s: RunParts, step: int, phase: str, fault: Fault) -> str:
        """Why ``fault`` cannot be recovered in the run (``""``: it can)."""
        if fault.kind == "trainer":
            return WHY_TRAINER
        if fault.kind not in ("rollout", "reward"):
            return "the failed process is not a worker the run can replace"
        if fault.kind == "rollout" and backend_of(s.config).serves_over_http:
            return "a rollout worker that owns SGLang servers is not replaced in the run"
        if s.config.run.max_recoveries == 0:
            return "run.max_recoveries=0 (no worker is replaced in the run)"
        if fault.kind == "rollout" and self.served is None:
            return UNSERVED
        # after a rollout the snapshot is that rollout's (:meth:`collect` settles it first; with
        # async_rollout the next step's); a rollout drawn again needs the step before's
        redrawn = phase not in AFTER_ROLLOUT
        if s.rollout.reference.caches_anchors and redrawn and self.snapshot_step != step - 1:
            return f"the rollout workers' anchor cache of step {step - 1} is not in the driver"
        return ""

    # ------------------------------------------------------------------ restore
    def restore_rollout(self, s: RunParts, new: int | None, everyone: bool) -> None:
        """The anchor cache of :attr:`snapshot` into the new rollout worker ``new`` (and every
        rollout worker with ``everyone``: the others ran part of the failed phase); a reset
        since the snapshot drops it again; then the new worker's weights."""
        fleet, ref_version = s.rollout.fleet, s.state.ref_version
        calls = []
        for i, actor in enumerate(fleet.reference_actors):
            fresh = new is not None and actor is fleet.actors[new]
            if self.snapshot is None or not (everyone or fresh):
                continue
            calls.append(actor.load_state_dict.remote(self.snapshot[i]))
            if not fresh and int(self.snapshot[i]["ref_version"]) != ref_version:
                calls.append(actor.reference_in_place.remote(ref_version, True))
        fleet.pending(calls, CallKind.CHECKPOINT, "rollout state restore").result()
        if new is not None:
            push_into_new(s, fleet.actors[new], self.snapshot_version(new, s))

    def snapshot_version(self, new: int, s: RunParts) -> int | None:
        """The reference version of the new worker's restored cache (``None``: no cache)."""
        if self.snapshot is None:
            return None
        fleet = s.rollout.fleet
        index = fleet.reference_actors.index(fleet.actors[new])
        return int(self.snapshot[index]["ref_version"])


def handles(s: RunParts) -> dict[str, object]:
    """The handles of the run's actors by kind (each with its ``actors``)."""
    return {"trainer": s.trainer, "rollout": s.rollout.fleet, "reward": s.reward}


def replace_actor(s: RunParts, fault: Fault) -> int | None:
    """A new actor in place of the dead one of ``fault``, made like it and started; returns
    its index among the rollout workers (``None`` for a reward worker)."""
    import ray

    from megatron_armor.orchestration.actors.rollout_worker import RolloutWorker
    from megatron_armor.orchestration.actors.workers import RewardWorker

    handle = s.rollout.fleet if fault.kind == "rollout" else s.reward
    cls = RolloutWorker if fault.kind == "rollout" else RewardWorker
    old, watch = handle.actors[fault.index], s.call_watch
    kill_run_processes([old], watch)  # a stopped process outlives ray.kill; so would its children
    try:
        ray.kill(old, no_restart=True)
    except Exception:  # noqa: BLE001 - it is dead already
        pass
    watch.forget(old)
    options, args = handle.specs[fault.index]
    new = start_actor(watch, cls, options, *args)
    ready = new.health.remote() if fault.kind == "rollout" else new.__ray_ready__.remote()
    Pending(watch, [ready], CallKind.STARTUP, f"{fault.actor}'s replacement start-up",
            timeout=handle.startup_timeout).result()  # fmt: skip
    handle.replace(fault.index, new)
    s.host_memory.replace(f"{fault.kind}{fault.index}", new)  # mem/* of the new process
    return fault.index if fault.kind == "rollout" else None


def push_into_new(s: RunParts, actor, cache_version: int | None) -> None:
    """The trainer's current policy (as ``state.policy_version``) and its reference (as
    ``state.ref_version``; clearing a restored cache of an older reference) into ``actor``."""
    state, trainer, fleet = s.state, s.trainer, s.rollout.fleet
    weights = s.recovery.served  # "behavior" while the engines draw the next step
    export = trainer.export(weights)
    fleet.pending(
        [actor.update_weights.remote(state.policy_version, *export.refs)],
        CallKind.WEIGHT_PUSH,
        "policy weights into a replaced rollout worker",
    ).result()
    if not s.weight_sync.anchors:  # no reference samples: the version only
        fleet.pending([actor.reference_in_place.remote(state.ref_version, False)],
                      CallKind.REFERENCE_VERSION, "rollout reference").result()  # fmt: skip
        return
    reset = cache_version is not None and cache_version != state.ref_version
    load = actor.reset_reference if reset else actor.load_reference
    export = trainer.export("ref")
    fleet.pending([load.remote(state.ref_version, *export.refs)], CallKind.WEIGHT_PUSH,
                  "reference weights into a replaced rollout worker").result()  # fmt: skip


def record(s: RunParts, step: int, phase: str, fault: Fault, count: int, budget,
           what: str = "") -> None:  # fmt: skip
    """The recovery on the console and in ``RUN_DIR/recoveries.jsonl`` (``what``: what was
    replaced, when not the fault's actor: SGLang servers restarted)."""
    redo = "rollout drawn again" if phase == "rollout" else f"{phase} done again"
    pushed = "the current weights pushed, " if fault.kind == "rollout" else ""
    reason = fault_reason(fault, s.call_watch)
    done = "restarted" if what else "replaced"
    print(f"recovery: {what or fault.actor} {reason} during step {step} ({phase}; "
          f"{fault.summary()}); {done}, {pushed}{redo} ({count} of run.max_recoveries="
          f"{budget.limit} within run.recovery_window={budget.window} steps)", flush=True)  # fmt: skip
    line = {"step": step, "phase": phase, "actor": what or fault.actor, "kind": fault.kind,
            "reason": reason, "error": fault.summary(), "time": time.time()}  # fmt: skip
    with (s.run_dir / RECOVERIES_FILE).open("a") as f:
        f.write(json.dumps(line) + "\n")


def fault_reason(fault: Fault, watch: CallWatch) -> str:
    """``stuck`` (past its call deadline without progress, killed by ``watch``; also when
    another call to the actor, waited for elsewhere, saw it die of that kill first) or
    ``died``."""
    if isinstance(fault.error, StuckCallError):
        return "stuck"
    return "stuck" if watch.killed_as_stuck(getattr(fault.error, "actor_id", None)) else "died"
