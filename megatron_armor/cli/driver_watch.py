"""What the ``armor`` parent knows of its driver, and when it is past its deadline.

The driver reports its phases and beats through the pipe (``supervisor_pipe.py``); the
parent (``cli/supervise.py``) feeds each message and the time it arrived to
:class:`DriverWatch` and asks :meth:`DriverWatch.overdue` once a second. The deadline of a
phase is the call deadlines' rule (``deadline_rule.DeadlineRule``, the same settings:
``orchestration.call_deadline_multiple`` x the ``call_deadline_quantile`` of the phase's last
durations, within ``[call_deadline_floor_s, call_deadline_cap_s]``; a phase's first run gets
the cap), learned from the run's own phases. The driver is *stalled* when its main loop has
not advanced for longer than the deadline of its phase: a SIGSTOP, a deadlock, a blocking call
no deadline covers, a write to a hung file system. After a stop signal it gets
``orchestration.stop_wait_s`` from the signal at most, so the parent exits within the
signal's lead. Before the driver has sent its rule (its config is not loaded yet) and in a
phase named ``-`` (after its run) only the stop signal's bound applies.

Pure: times are arguments (``time.monotonic()`` of the parent), nothing here reads a clock,
the pipe or a process.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_armor.supervisor_pipe import UNWATCHED

DEFAULT_STOP_WAIT_S = 60.0
"""``orchestration.stop_wait_s``'s default: the bound after a signal before the rule came."""
CHANGE_LOGGED = 1.25  # a phase's deadline is logged again when it moves by this factor


@dataclass(frozen=True)
class Stall:
    """A driver past its deadline: its phase and step, the seconds since its main loop last
    advanced and since its last heartbeat, the deadline it passed, and the stop signal that
    shortened it (``""``: none)."""

    phase: str
    step: int
    silent_s: float
    beat_s: float
    deadline_s: float
    signal: str = ""

    def describe(self, pid: int) -> str:
        """``the driver (pid N) made no progress for 31s in phase step of step 3, past its
        deadline of 30s; its last heartbeat came 31s ago``."""
        where = f"in phase {self.phase} of step {self.step}" if self.phase else "while starting"
        beat = (f"its last heartbeat came {self.beat_s:.0f}s ago" if self.beat_s > 2
                else "its heartbeat thread still answers")  # fmt: skip
        bound = (f"{self.signal} arrived and the driver did not move within "
                 f"orchestration.stop_wait_s={self.deadline_s:g}s" if self.signal
                 else f"past its deadline of {self.deadline_s:.0f}s")  # fmt: skip
        return (f"the driver (pid {pid}) made no progress for {self.silent_s:.0f}s {where}, "
                f"{bound}; {beat}")  # fmt: skip

    @property
    def cause(self) -> str:
        """What repeats when the same stall comes back (``requeue_history.py``)."""
        return f"the driver stalled in phase {self.phase or 'start'}"


class DriverWatch:
    """The driver's phase, its last progress and heartbeat, the learned phase durations."""

    def __init__(self, now: float) -> None:
        self.rule = None  # deadline_rule.DeadlineRule, once the driver sent its settings
        self.stop_wait_s = DEFAULT_STOP_WAIT_S
        self.phase, self.step, self.phase_start = "", 0, now
        self.last_beat = self.last_advance = now
        self.progress = -1
        self.stop_at: float | None = None
        self.stop_name = ""
        self.logged: dict[str, float] = {}

    # ------------------------------------------------------------------ messages
    def receive(self, key: str, value: str, now: float) -> list[str]:
        """Take one message of the driver; returns lines for the run log (a deadline that
        is new or moved). A malformed message is dropped (the watch goes on without it)."""
        try:
            return self.take(key, value, now)
        except ValueError:
            return []

    def take(self, key: str, value: str, now: float) -> list[str]:
        if key == "beat":
            self.last_beat = now
            if int(value) != self.progress:
                self.progress, self.last_advance = int(value), now
        elif key == "rule":
            return self.take_rule(value)
        elif key == "phase":
            step, _, phase = value.partition(" ")
            return self.enter(phase, int(step), now)
        return []

    def take_rule(self, value: str) -> list[str]:
        from megatron_armor.deadline_rule import HISTORY, DeadlineRule

        multiple, q, floor_s, cap_s, stop_wait_s = (float(x) for x in value.split())
        self.rule = DeadlineRule(multiple, q, floor_s, cap_s)
        self.stop_wait_s = stop_wait_s
        return [f"driver deadlines: {multiple:g} x p{q * 100:g} of each phase's last {HISTORY} "
                f"durations, within [{floor_s:g}s, {cap_s:g}s] (a phase's first run: "
                f"{cap_s:g}s) without progress of the driver's main loop; after a stop signal "
                f"{stop_wait_s:g}s (orchestration.stop_wait_s)"]  # fmt: skip

    def enter(self, phase: str, step: int, now: float) -> list[str]:
        """Phase ``phase`` of ``step`` begins: the one before ends and is learned."""
        lines, new = [], (phase, step) != (self.phase, self.step)
        if self.watched() and new:
            self.rule.observe(self.phase, now - self.phase_start)
            lines += self.deadline_line(self.phase)
        if new:
            self.phase_start = now
        self.phase, self.step, self.last_advance = phase, step, now
        return lines

    def deadline_line(self, phase: str) -> list[str]:
        """``driver deadline: step 30s`` when the phase's deadline is new or moved."""
        now = self.rule.deadline(phase)
        before = self.logged.get(phase)
        if before is not None and before / CHANGE_LOGGED <= now <= before * CHANGE_LOGGED:
            return []
        self.logged[phase] = now
        return [f"driver deadline: {phase} {now:.0f}s"]

    def stop_signal(self, name: str, now: float) -> None:
        """A stop signal (SIGTERM, SIGINT, SIGUSR1) reached the parent and was passed on."""
        if self.stop_at is None:
            self.stop_at, self.stop_name = now, name

    def parent_was_stopped(self, now: float) -> None:
        """The parent itself did not run for a while (its process group stopped, a suspended
        machine): what it did not see is no stall of the driver."""
        self.last_beat = self.last_advance = now
        if self.stop_at is not None:
            self.stop_at = now

    # ------------------------------------------------------------------ verdict
    def watched(self) -> bool:
        return self.rule is not None and self.phase not in ("", UNWATCHED)

    def deadline(self) -> float:
        return self.rule.deadline(self.phase) if self.watched() else float("inf")

    def overdue(self, now: float) -> Stall | None:
        """The stall, if the driver's main loop has not advanced within its deadline (or,
        after a stop signal, within ``stop_wait_s`` of the signal)."""
        silent, beat = now - self.last_advance, now - self.last_beat
        phase = self.phase if self.phase != UNWATCHED else ""
        if self.stop_at is not None and self.stop_wait_s < self.deadline():
            if now - max(self.last_advance, self.stop_at) > self.stop_wait_s:
                return Stall(phase, self.step, silent, beat, self.stop_wait_s, self.stop_name)
        if silent > self.deadline():
            return Stall(phase, self.step, silent, beat, self.deadline())
        return None
