"""Per-step throughput: tokens/s, TFLOP/s and MFU, peak GPU memory, weight-sync cost.

The driver never touches CUDA: :func:`peak_gpu_memory_gb` runs in the trainer and rollout
actors (each its own device) and :func:`gpu_memory_metrics` takes the largest of their peaks.

The loop feeds one :class:`ThroughputMeter` per step and logs :meth:`ThroughputMeter.pop_metrics`:

    meter.add_rollout(tokens=generated_tokens, seconds=t_gen)        # policy + reference
    meter.add_train(seq_lens=[len(s) for s in packed], seconds=t_train)
    meter.add_weight_sync(seconds=t_sync, num_bytes=sync_bytes)
    metrics.update(meter.pop_metrics())

MFU = model FLOPs of the training pass (``planner.flops.training_flops``, 3 x forward) /
(train seconds x trainer GPUs x peak dense FLOP/s of one GPU); see docs/profiling.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_armor.planner.devices import gpu_peaks
from megatron_armor.planner.flops import training_flops
from megatron_armor.planner.model import ModelDims


def peak_tflops(device_name: str, precision: str = "bf16") -> float | None:
    """Peak TFLOP/s for a ``torch.cuda.get_device_name()`` string, or ``None`` when unknown
    (``planner/devices.py``: the vendors' data sheets, dense)."""
    peaks = gpu_peaks(device_name)
    return peaks.peak_tflops(precision) if peaks else None


def compute_precision(precision: str, fp8: bool) -> str:
    """The tensor-core precision the training GEMMs run in, whose peak MFU is measured
    against: ``fp8`` when ``trainer.fp8.enabled`` (Transformer Engine), else
    ``trainer.precision``."""
    return "fp8" if fp8 else precision


def mfu(model_flops: float, seconds: float, num_gpus: int, peak_tflops_per_gpu: float) -> float:
    """``model_flops / (seconds * num_gpus * peak)``, a fraction in [0, 1]."""
    if seconds <= 0 or num_gpus <= 0 or peak_tflops_per_gpu <= 0:
        raise ValueError(
            f"mfu: seconds={seconds}, num_gpus={num_gpus}, peak={peak_tflops_per_gpu} must be > 0"
        )
    return model_flops / (seconds * num_gpus * peak_tflops_per_gpu * 1e12)


def peak_gpu_memory_gb(reset: bool = True) -> tuple[float, float] | None:
    """This process's ``(torch.cuda.max_memory_allocated, max_memory_reserved)`` on its current
    device in GB, reset for the next step (``None`` without CUDA). Reserved memory is what
    the caching allocator holds, tensors or not: what a colocated engine on the same GPU
    cannot have. Call it in an actor, never in the driver."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return allocated / 1e9, reserved / 1e9


def gpu_memory_metrics(
    trainer_gb: tuple[float, float] | None, rollout_gb: tuple[float, float] | None
) -> dict[str, float]:
    """``perf/peak_gpu_mem_gb`` (allocated) and ``perf/peak_gpu_reserved_gb`` (held by the
    caching allocator), each the max over every rank, and their trainer / rollout parts;
    ``trainer_gb`` / ``rollout_gb`` are :func:`peak_gpu_memory_gb` pairs."""
    out: dict[str, float] = {}
    for side, peaks in (("trainer", trainer_gb), ("rollout", rollout_gb)):
        if peaks is not None:
            out[f"perf/peak_gpu_mem_{side}_gb"], out[f"perf/peak_gpu_reserved_{side}_gb"] = peaks
    for kind in ("mem", "reserved"):
        parts = [v for k, v in out.items() if k.startswith(f"perf/peak_gpu_{kind}_")]
        if parts:
            out[f"perf/peak_gpu_{kind}_gb"] = max(parts)
    return out


@dataclass
class ThroughputMeter:
    """Accumulates one step's work and time; :meth:`pop_metrics` returns ``perf/*`` and resets."""

    dims: ModelDims | None = None
    """Model dims for FLOPs/MFU (``None``: tokens/s only)."""
    num_gpus: int = 1
    """Trainer GPUs the training time is spread over."""
    peak_tflops_per_gpu: float | None = None
    """Peak dense TFLOP/s of one GPU (``None``: no MFU)."""
    _rollout_tokens: int = field(default=0, init=False)
    _rollout_s: float = field(default=0.0, init=False)
    _train_seq_lens: list[int] = field(default_factory=list, init=False)
    _train_s: float = field(default=0.0, init=False)
    _sync_s: float = field(default=0.0, init=False)
    _sync_bytes: int = field(default=0, init=False)

    def reset(self) -> None:
        """Forget the step's work and time."""
        self._rollout_tokens, self._rollout_s = 0, 0.0
        self._train_seq_lens, self._train_s = [], 0.0
        self._sync_s, self._sync_bytes = 0.0, 0

    def add_rollout(self, tokens: int, seconds: float) -> None:
        """Generated (response) tokens and the wall seconds they took."""
        self._rollout_tokens += tokens
        self._rollout_s += seconds

    def add_train(self, seq_lens: list[int], seconds: float) -> None:
        """Sequence lengths (prompt + response) of a training pass and its wall seconds."""
        self._train_seq_lens.extend(seq_lens)
        self._train_s += seconds

    def add_weight_sync(self, seconds: float, num_bytes: int) -> None:
        """One trainer -> engine weight update."""
        self._sync_s += seconds
        self._sync_bytes += num_bytes

    def pop_metrics(self) -> dict[str, float]:
        """``perf/*`` metrics of the step so far; clears the accumulators."""
        out: dict[str, float] = {}
        if self._rollout_s > 0:
            out["perf/rollout_tokens_per_s"] = self._rollout_tokens / self._rollout_s
        if self._train_s > 0:
            out["perf/train_tokens_per_s"] = sum(self._train_seq_lens) / self._train_s
            out.update(self._flops_metrics())
        if self._sync_bytes or self._sync_s:
            out["perf/weight_sync_s"] = self._sync_s
            out["perf/weight_sync_gb"] = self._sync_bytes / 1e9
        self.reset()
        return out

    def _flops_metrics(self) -> dict[str, float]:
        if self.dims is None:
            return {}
        flops = training_flops(self.dims, self._train_seq_lens)
        out = {"perf/train_tflops_per_gpu": flops / (self._train_s * self.num_gpus) / 1e12}
        if self.peak_tflops_per_gpu:
            out["perf/mfu"] = mfu(flops, self._train_s, self.num_gpus, self.peak_tflops_per_gpu)
        return out


def e2e_devices(config) -> int:
    """The GPUs an end-to-end tokens/s/GPU divides by: every GPU of the job
    (``orchestration.nodes x gpus_per_node``, trainer and rollout alike, as NeMo-RL's
    ``cluster.num_nodes x gpus_per_node`` and verl's resource pools count); the ``cpu``
    layout has none and counts its trainer ranks."""
    from megatron_armor.config.world_size import allocation_gpus

    orch = config.orchestration
    if orch.layout == "cpu":
        return max(1, config.resolved.world_size)
    return max(1, allocation_gpus(orch))


def e2e_metrics(metrics: dict[str, float], devices: int) -> dict[str, float]:
    """End-to-end throughput in NeMo-RL's definition (docs/profiling.md, "Throughput in the
    peers' definitions"): the tokens of the batch the step trained on (prompt + response of
    each sample, ``train/prompt_tokens + train/response_tokens``) over the step's whole wall
    time (``timing/step_s``: generation, rewards, log-probs, updates, weight push and, at their
    steps, validation and the checkpoint) and over the job's ``devices``:
    ``perf/e2e_tokens_per_s_per_gpu``; ``perf/e2e_tokens_per_s`` is the job's total."""
    tokens = metrics.get("train/prompt_tokens", 0.0) + metrics.get("train/response_tokens", 0.0)
    per_s = tokens / metrics["timing/step_s"]
    return {"perf/e2e_tokens_per_s": per_s, "perf/e2e_tokens_per_s_per_gpu": per_s / devices}
