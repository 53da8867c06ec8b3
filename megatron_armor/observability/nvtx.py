"""NVTX ranges around the training phases, free when nothing is recording.

``with nvtx_range("rollout/policy"): ...`` marks a phase for Nsight Systems (``nsys``) and, while
a torch.profiler capture is running, as a ``record_function`` block in its trace. By default no
backend is enabled and :func:`nvtx_range` returns one shared no-op context: no import of
``nvtx`` or ``torch``, no allocation, no call into a tracing library. The profiler
(``observability/profiler.py``) enables a backend for the run (``nsys``, ``dlprof``) or for the
captured steps (``torch``); ``ARMOR_NVTX=1`` in the environment enables NVTX from the start
(e.g. under ``launch/profile.sh``).

Backends:
  - ``nvtx``: the ``nvtx`` package (``nvtx.push_range`` / ``pop_range``, domain ``armor``);
  - ``torch``: ``torch.profiler.record_function`` (visible in torch.profiler traces).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from megatron_armor.planner.step_phases import PHASE_NAMES

NVTX_DOMAIN = "armor"
PHASE_RANGES = PHASE_NAMES
"""Range names of the step's phases (``planner/step_phases.py``), so every process's timeline
reads the same in Nsight; the driver's phase timers open them (``observability/timers.py``)."""
_NULL_RANGE = contextlib.nullcontext()
_BACKENDS = ("nvtx", "torch")

_range_factory: Callable[[str], AbstractContextManager] | None = None
_backend: str | None = None


def nvtx_range(name: str) -> AbstractContextManager:
    """A context manager marking ``name`` as a range; the shared no-op when disabled."""
    if _range_factory is None:
        return _NULL_RANGE
    return _range_factory(name)


@contextlib.contextmanager
def _nvtx_package_range(name: str) -> Iterator[None]:
    import nvtx

    nvtx.push_range(message=name, domain=NVTX_DOMAIN)
    try:
        yield
    finally:
        nvtx.pop_range(domain=NVTX_DOMAIN)


def _torch_record_function(name: str) -> AbstractContextManager:
    import torch.profiler

    return torch.profiler.record_function(name)


def enable_nvtx(backend: str = "nvtx") -> None:
    """Route :func:`nvtx_range` to ``backend`` (``nvtx`` | ``torch``) until :func:`disable_nvtx`."""
    global _range_factory, _backend
    if backend not in _BACKENDS:
        raise ValueError(f"NVTX backend {backend!r}: choose one of {_BACKENDS}")
    if backend == "nvtx":
        try:
            import nvtx  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "NVTX ranges need the `nvtx` package: pip install nvtx (listed in requirements.txt)"
            ) from None
        _range_factory = _nvtx_package_range
    else:
        _range_factory = _torch_record_function
    _backend = backend


def disable_nvtx() -> None:
    """Back to the zero-cost no-op ranges."""
    global _range_factory, _backend
    _range_factory = None
    _backend = None


def nvtx_backend() -> str | None:
    """The enabled backend, or ``None`` when ranges are no-ops."""
    return _backend


def enable_from_env(environ: dict[str, str] | None = None) -> None:
    """Enable the ``nvtx`` backend when ``ARMOR_NVTX=1`` (set by ``launch/profile.sh``)."""
    if (environ if environ is not None else os.environ).get("ARMOR_NVTX", "0") == "1":
        enable_nvtx("nvtx")


enable_from_env()
