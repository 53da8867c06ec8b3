"""Step profilers: ``logging.profile`` = ``none`` | ``torch`` | ``nsys`` | ``dlprof``.

The training loop brackets every step with the same two calls, whatever the profiler::

    profiler = make_profiler(config.logging, rank=rank, out_dir=run_dir / "profile")
    for step in range(1, steps + 1):
        profiler.begin_step(step)
        ...                       # rollout, log-probs, train, weight sync (NVTX-ranged)
        profiler.end_step(step)
    profiler.close()

- ``torch``: a ``torch.profiler`` capture of each step in ``logging.profile_steps`` on each rank
  in ``logging.profile_ranks``, written as a Chrome trace
  ``<out_dir>/trace_rank<R>_step<S>.json`` (open in Perfetto / chrome://tracing); the phase
  ranges (``nvtx_range``) show as ``record_function`` blocks.
- ``nsys``: NVTX ranges on for the whole run and ``cudaProfilerStart``/``Stop`` around the chosen
  steps, so ``nsys profile --capture-range=cudaProfilerApi`` (``launch/profile.sh``) records only
  those steps; an NVTX range ``profile/step_<S>`` also marks them for ``--capture-range=nvtx``.
- ``dlprof``: as ``nsys`` plus ``torch.autograd.profiler.emit_nvtx`` for per-op ranges; needs the
  DLProf tool (older NGC PyTorch containers); where it is absent, a clear error at start-up.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from megatron_armor.observability import nvtx

PROFILERS = ("none", "torch", "nsys", "dlprof")


class ProfilerError(RuntimeError):
    """A profiler that cannot run here; the message says why and what to use instead."""


class StepProfiler:
    """Base: no profiling. Subclasses capture the steps in ``steps`` on this rank."""

    def __init__(self, steps: list[int] | None = None) -> None:
        self.steps = set(steps or [])

    def wants(self, step: int) -> bool:
        return step in self.steps

    def begin_step(self, step: int) -> None:
        """Called at the start of training step ``step`` (1-based)."""

    def end_step(self, step: int) -> None:
        """Called at the end of training step ``step``."""

    def close(self) -> None:
        """Stop any capture still running."""


class TorchStepProfiler(StepProfiler):
    """``torch.profiler`` capture of each chosen step, exported as a Chrome trace."""

    def __init__(self, steps: list[int], out_dir: str | Path, rank: int, name: str = "") -> None:
        """``name`` of the traces (``trace_<name>_step<S>.json``; default ``rank<rank>``)."""
        super().__init__(steps)
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.name = name or f"rank{rank}"
        self._prof: Any = None
        self.traces: list[Path] = []

    def begin_step(self, step: int) -> None:
        if not self.wants(step) or self._prof is not None:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._prof.__enter__()
        nvtx.enable_nvtx("torch")

    def end_step(self, step: int) -> None:
        if self._prof is None:
            return
        nvtx.disable_nvtx()
        # Which node the rank ran on, for multi-node runs (a top-level key of the trace).
        self._prof.add_metadata("armor_host", socket.gethostname())
        self._prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace_{self.name}_step{step}.json"
        self._prof.export_chrome_trace(str(path))
        self.traces.append(path)
        self._prof = None

    def close(self) -> None:
        if self._prof is not None:
            nvtx.disable_nvtx()
            self._prof.__exit__(None, None, None)
            self._prof = None


class CudaRangeProfiler(StepProfiler):
    """``cudaProfilerStart``/``Stop`` around the chosen steps, NVTX ranges for the whole run."""

    def __init__(self, steps: list[int], emit_op_ranges: bool = False) -> None:
        super().__init__(steps)
        import torch

        if not torch.cuda.is_available():
            raise ProfilerError(
                "logging.profile=nsys/dlprof needs CUDA (it captures GPU kernels); "
                "on CPU use logging.profile=torch"
            )
        self._torch = torch
        self._emit_op_ranges = emit_op_ranges
        self._stack: contextlib.ExitStack | None = None
        nvtx.enable_nvtx("nvtx")

    def begin_step(self, step: int) -> None:
        if not self.wants(step) or self._stack is not None:
            return
        self._stack = contextlib.ExitStack()
        self._torch.cuda.synchronize()
        self._torch.cuda.profiler.start()
        self._stack.callback(self._torch.cuda.profiler.stop)
        self._stack.callback(self._torch.cuda.synchronize)
        if self._emit_op_ranges:
            self._stack.enter_context(self._torch.autograd.profiler.emit_nvtx())
        self._stack.enter_context(nvtx.nvtx_range(f"profile/step_{step}"))

    def end_step(self, step: int) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def close(self) -> None:
        self.end_step(-1)
        nvtx.disable_nvtx()


def check_dlprof() -> None:
    """Raise :class:`ProfilerError` unless the DLProf tool and its PyTorch plugin exist."""
    if shutil.which("dlprof") is None:
        raise ProfilerError(
            "logging.profile=dlprof: the `dlprof` tool is not installed here. DLProf ships only "
            "in older NGC PyTorch containers (it is not on PyPI; `nvidia-dlprof` there is a "
            "placeholder). Use logging.profile=nsys with launch/profile.sh (Nsight Systems + "
            "NVTX ranges), or logging.profile=torch"
        )
    try:
        import nvidia_dlprof_pytorch_nvtx  # noqa: F401
    except ImportError:
        raise ProfilerError(
            "logging.profile=dlprof: `dlprof` exists but its PyTorch plugin "
            "`nvidia_dlprof_pytorch_nvtx` does not import; use the NGC container that ships "
            "both, or logging.profile=nsys"
        ) from None


def make_profiler(
    kind: str,
    steps: list[int],
    ranks: list[int],
    rank: int,
    out_dir: str | Path,
) -> StepProfiler:
    """The profiler for ``kind`` on ``rank`` (a no-op one when this rank is not profiled)."""
    if kind not in PROFILERS:
        raise ProfilerError(f"logging.profile={kind!r}: choose one of {PROFILERS}")
    if kind == "none":
        return StepProfiler()
    if not steps:
        print(
            f"profiler: logging.profile={kind} but logging.profile_steps is empty; "
            "nothing will be captured (set e.g. logging.profile_steps=[2,3])",
            file=sys.stderr,
        )
    if kind == "torch":
        return TorchStepProfiler(steps, out_dir, rank) if rank in ranks else StepProfiler()
    if kind == "dlprof":
        check_dlprof()
        import nvidia_dlprof_pytorch_nvtx

        nvidia_dlprof_pytorch_nvtx.init()
        return CudaRangeProfiler(steps, emit_op_ranges=True)
    return CudaRangeProfiler(steps)


def profile_steps_after_resume(steps: list[int], resume_step: int) -> tuple[list[int], str]:
    """``logging.profile_steps`` for a run that resumes after ``resume_step``: steps at or
    before it never run again, so they move just after it, spaced as given (``[2, 3]`` at a
    resume after step 50: ``[51, 52]``); returns the steps and a line saying so ('' when none
    moved)."""
    if not steps or min(steps) > resume_step:
        return list(steps), ""
    shift = resume_step + 1 - min(steps)
    moved = [step + shift for step in steps]
    return moved, (
        f"profiler: logging.profile_steps={list(steps)} are at or before the resume step "
        f"{resume_step} (those steps already ran): profiling steps {moved} instead"
    )


def profiler_from_config(logging_cfg: Any, rank: int, out_dir: str | Path) -> StepProfiler:
    """:func:`make_profiler` from a ``LoggingConfig`` (``profile``, ``profile_steps``, ``profile_ranks``)."""
    return make_profiler(
        logging_cfg.profile,
        list(logging_cfg.profile_steps),
        list(logging_cfg.profile_ranks),
        rank,
        out_dir,
    )
