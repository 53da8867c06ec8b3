"""The phases of a training step: the one vocabulary of the driver's time attribution
(``observability/timers.py: PhaseClock``), the NVTX ranges that mark them on a profile's
timeline, the planner's per-phase predictions (``planner/phase_time.py``) and ``armor report``.

Every second of a step's wall time belongs to exactly one phase on the driver's thread
(docs/metrics.md, ``phase/*``): the phase the driver is waiting on or working in. Work that
overlaps the step without holding the driver (the next step's rollout under
``orchestration.async_rollout: one_step``, a prefetched reference call) is not one of its
seconds; the driver's wait for it is (``rollout/wait``, ``rollout/reference``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPhase:
    """One phase: its NVTX range name, its metric ``phase/<key>_s`` and the hardware figure
    that measures how well it used the device (``efficiency``: ``mfu`` for the passes and the
    updates, ``bandwidth`` for decoding, ``push`` for the weight pushes, ``""`` for none)."""

    name: str
    key: str
    what: str
    efficiency: str = ""

    @property
    def metric(self) -> str:
        return f"phase/{self.key}_s"


STEP_PHASES = (
    StepPhase("rollout/policy", "rollout_policy", "policy generation: the engines decoding the on-policy samples", "bandwidth"),
    StepPhase("rollout/reference", "rollout_reference", "anchor generation: the reference samples (with rollout.reference_parts > 1, also the scoring of the parts beside them)", "bandwidth"),
    StepPhase("reward", "reward", "rewards: the wait for scores after the samples are in"),
    StepPhase("logprobs", "logprobs", "the old and reference log-prob passes (one trainer call)", "mfu"),
    StepPhase("train", "train", "the optimizer updates", "mfu"),
    StepPhase("weight_sync", "weight_sync", "the policy's weight push into the engines", "push"),
    StepPhase("reset", "reset", "a reference reset and its push", "push"),
    StepPhase("validate", "validate", "validation"),
    StepPhase("checkpoint", "checkpoint", "the checkpoint"),
    StepPhase("rollout/wait", "rollout_wait", "waiting: one_step's updates done, the next step's rollout not yet"),
    StepPhase("driver", "driver", "the driver's own work: advantages, packing, acceptance, anchor files, metrics, health checks, Ray calls outside the phases above"),
)  # fmt: skip
"""In the order a synchronous step runs them; ``driver`` holds every second of the step in
none of the others."""

PHASE_NAMES = tuple(p.name for p in STEP_PHASES)
DRIVER = "driver"


def step_phase(name: str) -> StepPhase:
    """The :class:`StepPhase` called ``name`` (a ``ValueError`` naming the phases otherwise)."""
    for phase in STEP_PHASES:
        if phase.name == name:
            return phase
    raise ValueError(f"step phase {name!r}: one of {', '.join(PHASE_NAMES)}")
