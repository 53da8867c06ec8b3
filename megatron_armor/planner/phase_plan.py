"""``armor plan``'s predicted step: each phase's seconds for the config on a device, with the
workload and the efficiencies it assumed (``planner/phase_time.py``), as text or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.planner.devices import GPU_PEAKS, DevicePeaks, gpu_peaks
from megatron_armor.planner.memory import GiB
from megatron_armor.planner.model import ModelDims
from megatron_armor.planner.phase_time import (
    Efficiency,
    Workload,
    WorkloadGuess,
    concurrent_sequences,
    layout_of,
    planned_workload,
    predict_step,
)
from megatron_armor.planner.plan import checkpoint_disk
from megatron_armor.planner.step_phases import STEP_PHASES


@dataclass
class PhasePlan:
    """Predicted seconds per phase of one step (per-step rates for validation, checkpoints,
    resets), with what they assumed."""

    device: DevicePeaks
    seconds: dict[str, float]
    workload: Workload
    efficiency: Efficiency
    guess: WorkloadGuess
    concurrency: float
    """Policy sequences one engine decodes at once (its KV cache's or batch's limit)."""

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    def report(self) -> str:
        lines = [f"predicted step on {self.device.name} ({self.device.source}): "
                 f"{self.step_seconds:.1f} s"]  # fmt: skip
        for phase in STEP_PHASES:
            value = self.seconds.get(phase.name, 0.0)
            if value > 0:
                lines.append(f"  {phase.name:<18} {value:10.2f} s")
        w = self.workload
        lines.append(
            f"  workload: {w.policy_sequences:.0f} policy + {w.reference_sequences:.0f} reference "
            f"samples of {w.prompt_len:.0f} + {w.policy_response_len:.0f} tokens; "
            f"{w.trained_sequences:.0f} trained sequences; {self.concurrency:.0f} sequences "
            "decoded at once per engine"
        )
        lines.append("  assumed: " + _fields(self.guess) + "; " + _fields(self.efficiency))
        lines.append("  not modelled (measured only): reward, driver; docs/profiling.md")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"device": self.device.as_dict(), "seconds": self.seconds,
                "step_seconds": self.step_seconds, "workload": asdict(self.workload),
                "concurrency": self.concurrency,
                "efficiency": asdict(self.efficiency), "guess": asdict(self.guess)}  # fmt: skip


def _fields(obj) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in asdict(obj).items())


def plan_device(name: str) -> DevicePeaks:
    """A GPU of the peak table by name (``H100 SXM``, ``H200``, a device name string)."""
    peaks = GPU_PEAKS.get(name) or gpu_peaks(name)
    if peaks is None:
        raise ValueError(f"--device {name!r}: not in the peak table; one of {', '.join(GPU_PEAKS)}")
    return peaks


def make_phase_plan(
    config: ArmorConfig, dims: ModelDims, device: DevicePeaks,
    efficiency: Efficiency | None = None, guess: WorkloadGuess | None = None,
    gpu_mem_gib: float = 80.0,
) -> PhasePlan:  # fmt: skip
    """The predicted step of ``config`` on ``device`` (planner/phase_time.py); the default
    efficiencies and workload guess unless given."""
    efficiency, guess = efficiency or Efficiency(), guess or WorkloadGuess()
    work = planned_workload(config, guess)
    ckpt, _ = checkpoint_disk(config, dims)
    seconds = predict_step(config, dims, device, work, efficiency, gpu_mem_gib * GiB, ckpt)
    lay = layout_of(config, dims, gpu_mem_gib * GiB)
    at_once = concurrent_sequences(lay, work.policy_sequences, work.prompt_len,
                                   work.policy_response_len)  # fmt: skip
    return PhasePlan(device, seconds, work, efficiency, guess, at_once)
