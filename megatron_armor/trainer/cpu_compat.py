"""Run megatron-core on CPU (gloo) when no GPU is present (docs/trainer.md).

megatron-core assumes CUDA in ~140 places: ``device="cuda"`` tensor factories, ``.cuda()``,
``torch.cuda.current_device()``, string checks such as
``param.type() == "torch.cuda.FloatTensor"`` in grad clipping and the distributed optimizer,
and the CUDA RNG tracker. Instead of patching sites one by one, :func:`enable_cpu_mode`
enters a :class:`torch.overrides.TorchFunctionMode` for the process lifetime that

- rewrites every CUDA ``device`` argument to CPU,
- makes ``Tensor.cuda()`` return the tensor and maps ``Tensor.to("cuda")`` to CPU,
- reports CUDA type names from ``Tensor.type()`` (the optimizers' dtype checks),

and replaces ``torch.cuda.current_device`` (-> CPU device), ``torch.cuda.synchronize`` and
``torch.cuda.empty_cache`` (no-ops), ``torch.cuda.Stream`` / ``current_stream`` / ``stream``
(one :class:`_HostStream` whose work is already done when it is queued: the MoE all-to-all
token dispatcher copies its split sizes to the host on a side stream) and that dispatcher's
device-to-host copy (:func:`_host_copy`: its split sizes become the host arrays the GPU path
makes of them), and installs megatron's no-op RNG tracker (``fork()`` is a
null context; dropout is off in RL fine-tuning). It is active only when CUDA is absent and
only for the megatron-core version it was verified with.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

VERIFIED_MEGATRON_CORE = "0.16.1"

_CPU = torch.device("cpu")
_PATCHED = False
_THREAD = threading.local()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _to_cpu_device(value: Any) -> Any:
    return _CPU if _is_cuda_device(value) else value


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA device requests to CPU for every torch call made inside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            return func(*args, **kwargs).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_to_cpu_device(a) for a in args)
        return func(*args, **kwargs)


class _HostEvent:
    """A CUDA event stand-in: host work is complete when it is recorded."""

    def synchronize(self) -> None:
        return None

    def wait(self, *_args: Any) -> None:
        return None


class _HostStream:
    """A CUDA stream stand-in: on the host every operation has finished when it returns, so
    waiting and synchronising are no-ops."""

    def wait_stream(self, _other: Any) -> None:
        return None

    def wait_event(self, _event: Any) -> None:
        return None

    def record_event(self, _event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        return None


_HOST_STREAM = _HostStream()


def _host_stream(*_args: Any, **_kwargs: Any) -> _HostStream:
    return _HOST_STREAM


def _stream_context(_stream: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _current_device() -> torch.device:
    return _CPU


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def check_megatron_version() -> None:
    """Fail clearly when the installed megatron-core is not the version CPU mode was verified with."""
    from megatron.core import package_info

    if package_info.__version__ != VERIFIED_MEGATRON_CORE:
        raise RuntimeError(
            f"CPU mode (trainer/cpu_compat.py) was verified with megatron-core "
            f"{VERIFIED_MEGATRON_CORE}, but {package_info.__version__} is installed; install "
            f"megatron-core=={VERIFIED_MEGATRON_CORE} for CPU runs, or run on a GPU"
        )


def cpu_mode_active() -> bool:
    """Whether :func:`enable_cpu_mode` has switched this process to CPU mode."""
    return _PATCHED


def enable_cpu_mode() -> bool:
    """Switch this process (and the calling thread) to CPU mode when CUDA is absent; return
    whether it is active.

    Idempotent. Call it before building any megatron-core object. A no-op with CUDA. Torch
    function modes are per thread, so a thread other than the one that first enabled the mode
    (e.g. a Ray actor's executor) calls it again before using the model.
    """
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if not _PATCHED:
        check_megatron_version()
        torch.cuda.current_device = _current_device
        torch.cuda.synchronize = _noop
        torch.cuda.empty_cache = _noop
        torch.cuda.Stream = _host_stream
        torch.cuda.current_stream = _host_stream
        torch.cuda.stream = _stream_context
        _install_noop_rng_tracker()
        _install_host_copy()
        _PATCHED = True
    if getattr(_THREAD, "mode", None) is None:
        _THREAD.mode = _CudaToCpuMode()
        _THREAD.mode.__enter__()
    return True


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` for host tensors: the copy to the host is not
    needed, but the NumPy array asked for is (the all-to-all takes split sizes as a sequence
    of ints; a tensor is refused)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _install_host_copy() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy


def _install_noop_rng_tracker() -> None:
    """megatron's inference tracker: ``add`` and ``set_states`` do nothing, ``fork`` is a null
    context, so no CUDA generator is ever touched."""
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
