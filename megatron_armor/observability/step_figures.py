"""Every figure of ``armor report``, computed from a run's ``metrics.jsonl`` lines and its
``report_facts.json`` (pure: no files, no clock), so a test recomputes them.

Per step (:func:`step_figures`):

- the seconds of each phase (``phase/*``) and their sum against ``timing/step_s``;
- throughput in the peers' definitions (docs/profiling.md, "Throughput in the peers'
  definitions"): NeMo-RL's tokens/s/GPU (``docs/about/performance-summary.md``: the trained
  batch's prompt + response tokens / the whole step's seconds / every GPU of the job), which
  is verl's ``perf/throughput`` too (``compute_throughout_metrics``: the batch's attention-mask
  tokens / ``timing_raw["step"]`` / the resource pools' GPUs), and prime-rl's trainer
  throughput (``perf/throughput``: trained tokens / the forward-backward-optimizer seconds,
  here the updates' ``phase/train_s``) per trainer GPU with its MFU;
- each phase's efficiency against the device's peaks (over several steps: their summed work
  over their summed capacity, :class:`Ratio`): MFU of the log-prob passes and of the
  updates (model FLOPs of ``planner/flops.py`` over the phase's seconds, the trainer's
  devices and the peak), memory-bandwidth utilization of decoding (the bytes of
  ``planner/phase_time.decode_bytes`` over ``timing/generate_s``, the engines' GPUs and the
  memory bandwidth), the weight push's GB/s and its share of the link's peak;
- the planner's predicted seconds of each phase for the work the step did
  (``planner/phase_time.measured_workload``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_armor.algo.losses import needs_reference_logprobs
from megatron_armor.planner.devices import DevicePeaks
from megatron_armor.planner.flops import forward_flops
from megatron_armor.planner.memory import GiB
from megatron_armor.planner.model import ModelDims
from megatron_armor.planner.phase_time import (
    Efficiency,
    decode_bytes,
    layout_of,
    link_gbps,
    measured_workload,
    predict_step,
)
from megatron_armor.planner.plan import checkpoint_disk
from megatron_armor.planner.step_phases import STEP_PHASES

SUM_TOLERANCE = 0.02
"""The phases of a step sum to ``timing/step_s`` within this share (docs/metrics.md)."""


@dataclass(frozen=True)
class RunContext:
    """What the figures need besides the lines: the config, the model, the peaks, the devices
    an end-to-end figure divides by."""

    config: object
    dims: ModelDims | None
    peaks: DevicePeaks | None
    devices: int
    precision: str = ""
    """The passes' tensor-core precision (``report_facts.json``: fp8 under
    ``trainer.fp8.enabled``); default ``trainer.precision``."""
    gpu_bytes: float = 80 * GiB
    efficiency: Efficiency = field(default_factory=Efficiency)


def _get(record: dict, key: str) -> float:
    value = record.get(key)
    return float(value) if value is not None and math.isfinite(value) else 0.0


def trained_tokens(record: dict) -> float:
    """Prompt + response tokens of the batch the step trained on."""
    return _get(record, "train/prompt_tokens") + _get(record, "train/response_tokens")


def throughput_figures(record: dict, ctx: RunContext) -> dict[str, float]:
    """The step's throughput in the peers' definitions (module docstring)."""
    step_s, tokens = _get(record, "timing/step_s"), trained_tokens(record)
    e2e = tokens / step_s / ctx.devices if step_s else 0.0
    train_s = _get(record, "phase/train_s")
    trainer_devices = max(1, ctx.config.resolved.world_size)
    return {"nemo_rl_tokens_per_s_per_gpu": e2e, "verl_throughput": e2e,
            "prime_rl_tokens_per_s_per_gpu": tokens / train_s / trainer_devices if train_s else 0.0}  # fmt: skip


@dataclass(frozen=True)
class Ratio:
    """An efficiency as its work over the most the devices could have done in the seconds
    taken, so a mean over steps is the ratio of the sums (a step with a near-empty phase
    does not swing it)."""

    work: float
    capacity: float

    @property
    def value(self) -> float | None:
        return self.work / self.capacity if self.capacity > 0 else None


def _trainer_capacity(seconds: float, ctx: RunContext) -> float:
    """FLOPs the trainer's devices could do in ``seconds`` at the precision's peak."""
    peak = ctx.peaks.peak_tflops(ctx.precision or ctx.config.trainer.precision) or 0.0
    return seconds * max(1, ctx.config.resolved.world_size) * peak * 1e12


EFFICIENCIES = ("logprobs_mfu", "train_mfu", "decode_bandwidth_util", "push_gb_per_s",
                "push_link_util")  # fmt: skip


def efficiency_ratios(record: dict, ctx: RunContext) -> dict[str, Ratio] | None:
    """Each phase's efficiency against the peaks (module docstring), as :class:`Ratio`;
    ``None`` where the model or the device's peaks are unknown. ``push_gb_per_s`` is GB over
    seconds; ``push_link_util`` GB over what the link's peak moves in those seconds."""
    if ctx.dims is None or ctx.peaks is None:
        return None
    work = measured_workload(record, ctx.config)
    fwd = work.trained_sequences * forward_flops(ctx.dims, max(1, round(work.trained_len)))
    passes = 2.0 if needs_reference_logprobs(ctx.config.algo) else 1.0
    lay = layout_of(ctx.config, ctx.dims, ctx.gpu_bytes)
    drawn = ((work.policy_sequences, work.policy_response_len, work.policy_decode_steps),
             (work.reference_sequences, work.reference_response_len, work.reference_decode_steps))  # fmt: skip
    decoded = lay.engines * sum(
        decode_bytes(ctx.dims, lay, n, work.prompt_len, r, steps) for n, r, steps in drawn
        if n > 0 and r > 0
    )  # fmt: skip
    memory = lay.engines * lay.engine_tp * ctx.peaks.memory_gbps * 1e9
    push_s, push_gb = _get(record, "perf/weight_sync_s"), _get(record, "perf/weight_sync_gb")
    return {
        "logprobs_mfu": Ratio(passes * fwd, _trainer_capacity(_get(record, "phase/logprobs_s"), ctx)),
        "train_mfu": Ratio(3 * fwd, _trainer_capacity(_get(record, "phase/train_s"), ctx)),
        "decode_bandwidth_util": Ratio(decoded, _get(record, "timing/generate_s") * memory),
        "push_gb_per_s": Ratio(push_gb, push_s),
        "push_link_util": Ratio(push_gb, push_s * link_gbps(ctx.peaks, lay, ctx.efficiency)),
    }  # fmt: skip


def efficiency_figures(ratios: dict[str, Ratio] | None) -> dict[str, float | None]:
    """The values of :func:`efficiency_ratios` (``None`` each where unknown)."""
    return {k: ratios[k].value if ratios else None for k in EFFICIENCIES}


def predicted_phases(record: dict, ctx: RunContext) -> dict[str, float] | None:
    """The planner's seconds of each phase for the work this step did (``None`` without the
    model or the peaks)."""
    if ctx.dims is None or ctx.peaks is None:
        return None
    work = measured_workload(record, ctx.config)
    ckpt, _ = checkpoint_disk(ctx.config, ctx.dims)
    return predict_step(ctx.config, ctx.dims, ctx.peaks, work, ctx.efficiency, ctx.gpu_bytes, ckpt)


def step_figures(record: dict, ctx: RunContext) -> dict:
    """Every figure of one step (module docstring)."""
    phases = {p.name: _get(record, p.metric) for p in STEP_PHASES}
    return {
        "step": int(record["step"]),
        "step_s": _get(record, "timing/step_s"),
        "overlap_s": record.get("async/overlap_s"),
        "phases": phases,
        "phase_sum_s": sum(phases.values()),
        "tokens": trained_tokens(record),
        "throughput": throughput_figures(record, ctx),
        "ratios": (ratios := efficiency_ratios(record, ctx)),
        "efficiency": efficiency_figures(ratios),
        "predicted": predicted_phases(record, ctx),
    }


def training_steps(records: list[dict]) -> list[dict]:
    """The lines of training steps (step 0 is the validation before the first update)."""
    return [r for r in records if int(r["step"]) >= 1 and "timing/step_s" in r]


def mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def summary(rows: list[dict]) -> dict:
    """Means over the steps: seconds per phase (measured and predicted), throughput, the
    efficiencies; the last five steps' NeMo-RL figure (NeMo-RL's table averages five)."""
    names = [p.name for p in STEP_PHASES]
    predicted = [r["predicted"] for r in rows if r["predicted"] is not None]
    return {
        "steps": len(rows),
        "step_s": mean([r["step_s"] for r in rows]),
        "overlap_s": mean([r["overlap_s"] for r in rows]),
        "phases": {n: mean([r["phases"][n] for r in rows]) for n in names},
        "predicted": {n: mean([p[n] for p in predicted]) for n in names} if predicted else None,
        "throughput": {k: mean([r["throughput"][k] for r in rows]) for k in rows[0]["throughput"]},
        "last5_nemo_rl": mean([r["throughput"]["nemo_rl_tokens_per_s_per_gpu"] for r in rows[-5:]]),
        "efficiency": efficiency_figures(summed_ratios(rows)),
    }  # fmt: skip


def summed_ratios(rows: list[dict]) -> dict[str, Ratio] | None:
    """Each efficiency over all the steps: summed work over summed capacity."""
    if any(r["ratios"] is None for r in rows):
        return None
    return {k: Ratio(sum(r["ratios"][k].work for r in rows),
                     sum(r["ratios"][k].capacity for r in rows)) for k in EFFICIENCIES}  # fmt: skip
