"""The run's metric watchers wired into the loop: keep-best, the over-optimization stop and
the warnings of a long run (``observability/health.py``: acceptance, host memory, disk).

After each step the loop hands its metrics to :meth:`RunWatch.observe`, which returns the
detector's ``overopt/*`` evidence to log. :attr:`RunWatch.wants_checkpoint` asks for a
checkpoint at a new best (``run.keep_best``) and when the detector fires;
:attr:`RunWatch.stopped` ends the run once the detector fired with ``overopt.stop``. The state
travels in the orchestrator checkpoint (``RunState.watch``), so a resumed run keeps the same
best and the same decision; ``checkpoints/best.json`` mirrors the best for tools
(``armor convert --to-hf RUN best``, ``armor pipeline``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.validate import short_batch_floor
from megatron_armor.observability.health import AcceptanceLimits, HealthWatch
from megatron_armor.observability.watchers import BestTracker, OveroptDetector
from megatron_armor.orchestration.run import checkpoints


def acceptance_limits(config: ArmorConfig) -> AcceptanceLimits:
    """The acceptance thresholds of ``config`` (``observability/health.py``)."""
    a, r = config.algo, config.rollout
    return AcceptanceLimits(capacity=a.max_gen_batches * r.gen_batch, need=r.batch,
                            floor=short_batch_floor(config), steps=config.run.steps)  # fmt: skip


def health_watch(config: ArmorConfig) -> HealthWatch:
    w = config.watch
    return HealthWatch(acceptance_limits(config), w.window, w.memory_growth_gb, w.repeat_every)


class RunWatch:
    """Keep-best tracker and over-optimization detector of one run (either may be off)."""

    def __init__(self, config: ArmorConfig):
        best, overopt = config.run.keep_best, config.overopt
        k = f"@{config.validation.n_samples}"  # `avg@k` names the run's validation k
        self.best = BestTracker(best.metric.replace("@k", k), best.mode) if best.metric else None
        self.detector = None
        if overopt.enabled:
            resolved = replace(overopt, val_metric=overopt.val_metric.replace("@k", k))
            self.detector = OveroptDetector(resolved)
        self.stop_on_fire = config.overopt.stop
        self.wants_checkpoint = False
        self.health = health_watch(config)

    def observe(self, step: int, metrics: Mapping[str, float | None]) -> dict[str, float]:
        """Take one step's metrics; returns the ``overopt/*`` and ``watch/*`` metrics to log
        with them, and prints the long-run warnings due now."""
        new_best = self.best is not None and self.best.observe(step, metrics)
        evidence = self.detector.observe(step, metrics) if self.detector else {}
        self.wants_checkpoint = new_best or bool(evidence.get("overopt/fired"))
        evidence.update(self.health.observe(step, metrics))
        for line in self.health.lines:
            print(line, flush=True)
        return evidence

    @property
    def stopped(self) -> bool:
        """The detector fired and ``overopt.stop`` ends the run."""
        return bool(self.detector and self.stop_on_fire and self.detector.fired_step is not None)

    def best_record(self) -> dict | None:
        return self.best.record() if self.best else None

    def publish(self, run_dir: str | Path) -> None:
        """Mirror the best record into ``checkpoints/best.json`` (before the rotation runs)."""
        if self.best is not None:
            checkpoints.write_best(run_dir, self.best_record())

    def state_dict(self) -> dict:
        return {
            "best": self.best.state_dict() if self.best else None,
            "overopt": self.detector.state_dict() if self.detector else None,
            "health": self.health.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if self.best is not None and state.get("best"):
            self.best.load_state_dict(state["best"])
        if self.detector is not None and state.get("overopt"):
            self.detector.load_state_dict(state["overopt"])
        self.health.load_state_dict(state.get("health") or {})

    def stop_line(self) -> str:
        """What the run prints when the detector ended it."""
        d = self.detector.state
        return (f"over-optimization detected at step {d.fired_step}: "
                f"{self.detector.config.val_metric} best {d.best_val:.4f} at step {d.best_step}, "
                f"no new best for {d.stale} validations while the training reward rose")  # fmt: skip
