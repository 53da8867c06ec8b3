"""Reference reset schedule (docs/algorithm.md, reference reset, Algorithm 1 lines 24-27).

A pure object: the RL loop asks ``should_reset(step)`` after finishing step ``step``
(1-based), performs the reset (policy -> reference on the trainer and rollout sides, anchor
cache invalidated) and calls ``record_reset(step)``. Its state goes into the checkpoint so a
resumed run keeps the same reference period.

Rules (a function each, mapped by name in ``registry.py``):

- ``none``         never
- ``every``        ``step % every == 0``
- ``every-until``  ``step % every == 0 and step <= until`` (then frozen; Qwen3-8B: 1 until 180)
- ``log2``         ``step`` is a power of two (1, 2, 4, 8, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field


def never(step: int, every: int, until: int) -> bool:
    """``none``: no reset."""
    return False


def every_tau(step: int, every: int, until: int) -> bool:
    """``every``: reset when ``step % every == 0``."""
    return step % every == 0


def every_until(step: int, every: int, until: int) -> bool:
    """``every-until``: reset when ``step % every == 0`` and ``step <= until``."""
    return step % every == 0 and step <= until


def power_of_two(step: int, every: int, until: int) -> bool:
    """``log2``: reset when ``step`` is a power of two."""
    return step >= 1 and step & (step - 1) == 0


def check_schedule(kind: str, every: int, until: int) -> None:
    """Raise ``ValueError`` naming the setting and the fix when the schedule is inconsistent."""
    from megatron_armor.algo.registry import RESET_SCHEDULES, lookup  # registry imports us

    lookup(RESET_SCHEDULES, kind, "algo.reset.schedule")
    if kind in ("every", "every-until") and every < 1:
        raise ValueError(
            f"algo.reset.every={every}: schedule {kind!r} needs every >= 1 (steps between resets)"
        )
    if kind == "every-until" and until < every:
        raise ValueError(
            f"algo.reset.until={until}: must be >= algo.reset.every={every} for 'every-until' "
            "(otherwise no reset ever happens; use schedule 'none' for that)"
        )


@dataclass
class ResetSchedule:
    """When to copy the policy into the reference; ``resets`` lists the steps already done."""

    kind: str = "none"
    every: int = 0
    until: int = 0
    resets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_schedule(self.kind, self.every, self.until)

    def should_reset(self, step: int) -> bool:
        """Whether to reset after finishing 1-based ``step``."""
        from megatron_armor.algo.registry import RESET_SCHEDULES  # registry imports this module

        if step < 1:
            raise ValueError(f"step={step}: steps are 1-based")
        return RESET_SCHEDULES[self.kind](step, self.every, self.until)

    def record_reset(self, step: int) -> None:
        """Note that the reference was reset after ``step``."""
        if self.resets and step <= self.resets[-1]:
            raise ValueError(f"reset at step {step} recorded after a reset at {self.resets[-1]}")
        self.resets.append(step)

    @property
    def last_reset(self) -> int:
        """Step of the latest reset (0 = the reference is still the starting checkpoint)."""
        return self.resets[-1] if self.resets else 0

    def state_dict(self) -> dict:
        """Checkpointable state (plain Python types)."""
        return {
            "kind": self.kind,
            "every": self.every,
            "until": self.until,
            "resets": list(self.resets),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``resets``; the saved rule must match this schedule's (no silent change)."""
        saved = (state["kind"], state["every"], state["until"])
        if saved != (self.kind, self.every, self.until):
            raise ValueError(
                f"checkpointed reset schedule {saved} differs from algo.reset "
                f"{(self.kind, self.every, self.until)}; resume with the checkpoint's algo.reset "
                "settings or start a new run"
            )
        self.resets = [int(s) for s in state["resets"]]
