"""Warnings of a long run: acceptance falling toward the error, host memory growing, the run
directory outgrowing its disk (docs/troubleshooting.md, "Warnings of a long run").

Each watcher reads the per-step metrics the loop logs and returns ``watch/*`` metrics (its
warning is one of them, 0 or 1, every step) and, when a warning turns on, a console line.
Pure Python: no I/O (the memory and disk numbers come in as ``mem/*`` and ``disk/*``).

**Acceptance** (:class:`AcceptanceWatch`). A step that needs all its batches sees ``C =
max_gen_batches * gen_batch`` queries and accepts ``k ~ Binomial(C, r)`` of them at
acceptance rate ``r``: it is short when ``k < B`` and fails when ``k < floor`` (the
short-batch floor, ``config.validate.short_batch_floor``; ``= B`` with ``algo.on_short_batch:
error``). The *danger rate* of a count ``m`` is the ``r`` at which ``m`` lies two standard
deviations below the mean, ``r - 2 sqrt(r (1 - r) / C) = m / C`` (:func:`danger_rate`, the
larger root: a step at that rate falls short of ``m`` about once in 40). Over the last
``window`` steps a least-squares line ``r(s) = a + b s`` is fitted through
``anchor/acceptance_rate`` (from a full window on) and followed to the danger rates of ``B``
and of the floor: ``steps_to_error = (r(now) - r_danger(floor)) / -b`` while the line falls
beyond its noise (``b + 2 se(b) < 0``), 0 once ``r(now)`` is at or below it, none otherwise.
The warning is on while that falls before ``run.steps``.

**Memory** (:class:`MemoryWatch`). The slope of ``mem/run_gb`` over the last ``window``
steps, times 100; the warning is on while it exceeds ``watch.memory_growth_gb``. It needs a
full window since the process started (a resumed run's processes are new: their history is
not carried over), which also keeps start-up growth (allocator pools, the object store) out.

**Disk** (:class:`DiskWatch`). At each periodic checkpoint step the run directory's size
(``disk/run_dir_gb``, measured before that step's checkpoint) joins a series; from two points
on, ``projected = max(slope, 0) (run.steps - step) + checkpoint`` (the growth until the last
step, plus one checkpoint, which exists beside the previous one until the rotation); the
warning is on while that exceeds ``disk/free_gb``.

The acceptance and disk series travel in the orchestrator checkpoint (``state_dict``): a
resumed run logs the same ``watch/acceptance_*`` as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_armor.observability.watchers import least_squares


def danger_rate(count: int, capacity: int, z: float = 2.0) -> float:
    """The acceptance rate ``r`` with ``r - z sqrt(r (1 - r) / C) = count / C`` (the larger
    root of ``(1 + k) r^2 - (2 e + k) r + e^2 = 0``, ``e = count / C``, ``k = z^2 / C``):
    below it a step of ``C`` queries accepts fewer than ``count`` more often than ``z``
    standard deviations allow."""
    e, k = count / capacity, z * z / capacity
    b = 2 * e + k
    return (b + (b * b - 4 * (1 + k) * e * e) ** 0.5) / (2 * (1 + k))


def steps_until(level: float, slope: float, threshold: float) -> float | None:
    """Steps until a line at ``level`` falling by ``slope`` per step reaches ``threshold``:
    0 at or below it, ``None`` when it does not fall."""
    if level <= threshold:
        return 0.0
    if slope >= 0:
        return None
    return (level - threshold) / -slope


@dataclass(frozen=True)
class AcceptanceLimits:
    """The run's acceptance thresholds (module docstring)."""

    capacity: int
    """``C = algo.max_gen_batches * rollout.gen_batch``: queries a step can see at most."""
    need: int
    """``B = rollout.batch``."""
    floor: int
    """The fewest accepted queries a step trains on."""
    steps: int
    """``run.steps``."""

    @property
    def short_rate(self) -> float:
        """The danger rate of ``B``: steps turn short below it."""
        return danger_rate(self.need, self.capacity)

    @property
    def error_rate(self) -> float:
        """The danger rate of the floor: steps fail below it."""
        return danger_rate(self.floor, self.capacity)


class AcceptanceWatch:
    """``watch/acceptance_*`` and ``watch/short_batches`` (module docstring)."""

    def __init__(self, limits: AcceptanceLimits, window: int):
        self.limits, self.window = limits, window
        self.points: list[list[float]] = []
        self.short_batches = 0
        self.message = ""

    def _fit(self, step: int) -> dict[str, float]:
        fit = least_squares(self.points) if len(self.points) >= self.window else None
        if fit is None:
            return {}
        slope, intercept, _, slope_se = fit
        level = intercept + slope * step
        out = {"watch/acceptance_fit": level, "watch/acceptance_slope_per_100": 100 * slope,
               "watch/acceptance_slope_se_per_100": 100 * slope_se}  # fmt: skip
        if self.limits.floor:
            out["watch/acceptance_error_rate"] = self.limits.error_rate
        falling = slope if slope + 2 * slope_se < 0 else 0.0  # beyond the noise, else flat
        rates = [("short", self.limits.short_rate)]
        if self.limits.floor:  # a floor of 0 (algo.min_batch_fraction: 0) never fails a step
            rates.append(("error", self.limits.error_rate))
        for name, rate in rates:
            until = steps_until(level, falling, rate)
            if until is not None:
                out[f"watch/acceptance_steps_to_{name}"] = until
        return out

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> dict[str, float]:
        rate = metrics.get("anchor/acceptance_rate")
        if rate is None:
            return {}
        self.points = [*self.points, [step, float(rate)]][-self.window :]
        self.short_batches += int(bool(metrics.get("anchor/short_batch")))
        out = {"watch/short_batches": float(self.short_batches), **self._fit(step)}
        until = out.get("watch/acceptance_steps_to_error")
        warn = until is not None and step + until <= self.limits.steps
        out["watch/acceptance_warning"] = float(warn)
        self.message = self._message(step, out) if warn else ""
        return out

    def _message(self, step: int, m: dict[str, float]) -> str:
        lim, until = self.limits, m["watch/acceptance_steps_to_error"]
        when = "now" if until == 0 else f"in ~{until:.0f} steps (step {step + until:.0f})"
        return (f"acceptance {m['watch/acceptance_fit']:.3f} ({m['watch/acceptance_slope_per_100']:+.3f} "
                f"per 100 steps) reaches {lim.error_rate:.3f} {when}, before run.steps="
                f"{lim.steps}: there a step of {lim.capacity} queries (algo.max_gen_batches x "
                f"rollout.gen_batch) often accepts fewer than {lim.floor} and fails "
                "(AcceptanceError, exit 3); set data.retire_solved_after, raise "
                "algo.max_gen_batches or rollout.gen_batch, or lower algo.min_batch_fraction")  # fmt: skip

    def state_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "short_batches": self.short_batches}

    def load_state_dict(self, state: dict) -> None:
        self.points = [[int(s), float(v)] for s, v in state.get("points", [])]
        self.short_batches = int(state.get("short_batches", 0))


class MemoryWatch:
    """``watch/memory_*`` (module docstring); its series restarts with the process."""

    def __init__(self, window: int, growth_gb_per_100: float):
        self.window, self.threshold = window, growth_gb_per_100
        self.points: list[list[float]] = []
        self.message = ""

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> dict[str, float]:
        used = metrics.get("mem/run_gb")
        if used is None:
            return {}
        self.points = [*self.points, [step, float(used)]][-self.window :]
        fit = least_squares(self.points) if len(self.points) >= self.window else None
        if fit is None:
            self.message = ""
            return {"watch/memory_warning": 0.0}
        growth = 100 * fit[0]
        out = {"watch/memory_growth_gb_per_100": growth, "watch/memory_warning": 0.0}
        free = [v for k, v in metrics.items() if k.endswith("_available_gb") and v is not None]
        if growth > 0 and free:
            out["watch/memory_steps_to_full"] = 100 * min(free) / growth
        if growth > self.threshold:
            out["watch/memory_warning"] = 1.0
        self.message = self._message(growth, out) if out["watch/memory_warning"] else ""
        return out

    def _message(self, growth: float, m: dict[str, float]) -> str:
        full = m.get("watch/memory_steps_to_full")
        left = f"; at this rate a node is out of memory in ~{full:.0f} steps" if full else ""
        return (f"host memory of the run (mem/run_gb) grows {growth:.2f} GB per 100 steps over "
                f"the last {self.window} steps, above watch.memory_growth_gb={self.threshold}"
                f"{left}; see the mem/* keys for the process that grows")  # fmt: skip


class DiskWatch:
    """``watch/disk_*`` (module docstring)."""

    def __init__(self, steps: int, samples: int = 20):
        self.steps, self.samples = steps, samples
        self.points: list[list[float]] = []
        self.warning = False
        self.message = ""

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> dict[str, float]:
        size, free = metrics.get("disk/run_dir_gb"), metrics.get("disk/free_gb")
        if size is None or free is None:  # between checkpoints: the last decision stands
            return {"watch/disk_warning": float(self.warning)} if self.points else {}
        self.points = [*self.points, [step, float(size)]][-self.samples :]
        fit = least_squares(self.points)
        if fit is None:
            return {"watch/disk_warning": float(self.warning)}
        checkpoint = float(metrics.get("disk/checkpoint_gb") or 0.0)
        projected = max(fit[0], 0.0) * (self.steps - step) + checkpoint
        self.warning = projected > free
        self.message = (f"the run directory grows {100 * fit[0]:.3f} GB per 100 steps: "
                        f"{projected:.2f} GB more by run.steps={self.steps} (with one more "
                        f"checkpoint) but {free:.2f} GB are free; free space, lower run.keep_last "
                        "or move run.output_dir") if self.warning else ""  # fmt: skip
        return {"watch/disk_growth_gb_per_100": 100 * fit[0], "watch/disk_projected_gb": projected,
                "watch/disk_warning": float(self.warning)}  # fmt: skip

    def state_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "warning": self.warning}

    def load_state_dict(self, state: dict) -> None:
        self.points = [[int(s), float(v)] for s, v in state.get("points", [])]
        self.warning = bool(state.get("warning", False))


class HealthWatch:
    """The three watchers; :meth:`observe` once a step, :attr:`lines` the console warnings
    to print now: a warning that is on, unless it was printed within the last
    ``repeat_every`` steps (on, then every ``repeat_every`` steps while on, and a warning that
    flickers prints at most that often)."""

    def __init__(self, limits: AcceptanceLimits, window: int, growth_gb: float, repeat: int):
        self.acceptance = AcceptanceWatch(limits, window)
        self.memory = MemoryWatch(window, growth_gb)
        self.disk = DiskWatch(limits.steps)
        self.repeat = repeat
        self.printed: dict[str, int] = {}  # the step each warning was last printed at
        self.lines: list[str] = []

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> dict[str, float]:
        out: dict[str, float] = {}
        self.lines = []
        for name in ("acceptance", "memory", "disk"):
            watcher = getattr(self, name)
            out.update(watcher.observe(step, metrics))
            last = self.printed.get(name)
            if watcher.message and (last is None or step - last >= self.repeat):
                self.printed[name] = step
                self.lines.append(f"warning: step {step}: {watcher.message}")
        return out

    def state_dict(self) -> dict:
        return {"acceptance": self.acceptance.state_dict(), "disk": self.disk.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.acceptance.load_state_dict(state.get("acceptance", {}))
        self.disk.load_state_dict(state.get("disk", {}))
