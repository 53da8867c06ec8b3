"""Whether a run's checkpoint fits in the job's signal lead.

``slurm/armor.sbatch`` signals the driver ``ARMOR_SIGNAL_LEAD_S`` seconds before the job's time
limit (it exports the variable); the driver then finishes the step in flight and writes a
checkpoint. When a step plus a checkpoint take longer than the lead, the time limit kills the
job first and the requeued run loses every step since the last periodic checkpoint.
:class:`SignalLeadWatch` says so once, after the first steps and the first checkpoint, from the
run's own timings (the 95th percentile of its step times).
"""

from __future__ import annotations

import math

from megatron_armor import env_settings

LEAD_ENV = "ARMOR_SIGNAL_LEAD_S"
MIN_STEPS = 5
"""Steps timed before the first verdict (the first steps are slower: compilation, caches)."""


def p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.95 * len(ordered)) - 1, 0)]


class SignalLeadWatch:
    """Collects step and checkpoint times; :meth:`observe` returns the warning once."""

    def __init__(self, lead_s: float | None, min_steps: int = MIN_STEPS):
        self.lead_s, self.min_steps = lead_s, min_steps
        self.steps: list[float] = []
        self.checkpoint_s: float | None = None
        self.warned = False

    @classmethod
    def from_environment(cls) -> SignalLeadWatch:
        """The lead the sbatch file exported (none outside it: nothing to check); a bad value
        was refused when ``armor`` started (``env_settings.py``)."""
        return cls(env_settings.value(LEAD_ENV))

    def observe(self, step_s: float, checkpoint_s: float | None) -> str | None:
        """Record one step (``step_s`` without its checkpoint, ``checkpoint_s`` when it wrote
        one); the warning when ``p95(step) + checkpoint`` first exceeds the lead."""
        if self.lead_s is None or self.warned:
            return None
        self.steps.append(step_s)
        if checkpoint_s is not None:
            self.checkpoint_s = checkpoint_s
        if len(self.steps) < self.min_steps or self.checkpoint_s is None:
            return None
        step = p95(self.steps)
        if step + self.checkpoint_s <= self.lead_s:
            return None
        self.warned = True
        return (
            f"warning: a step takes up to {step:.0f} s (p95 of {len(self.steps)}) and a "
            f"checkpoint {self.checkpoint_s:.0f} s, more than the {self.lead_s:.0f} s between "
            f"the time-limit signal and the limit ({LEAD_ENV}): the job may be killed before "
            f"its checkpoint; submit with {LEAD_ENV}={math.ceil(1.5 * (step + self.checkpoint_s))} "
            "(slurm/armor.sbatch) or rely on run.ckpt_every"
        )
