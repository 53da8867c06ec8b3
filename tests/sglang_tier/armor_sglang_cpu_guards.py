"""Start-up guards that let SGLang 0.5.23 (its CUDA-13 wheel) serve on a machine without a CUDA
driver. TEST-ONLY: ``scripts/sglang_env.sh`` copies this file into the sglang test tier's own
virtualenv with a ``.pth`` line that imports it at every interpreter start there; nothing in the
project imports it, and no GPU node has it (docs/gpu.md, "The sglang test tier").

Each guard changes a module of the wheel right after it is imported (a meta-path finder wraps
its loader), without editing an installed file:

- ``sgl_kernel.load_utils``: ``_load_architecture_specific_ops`` raises ``ImportError`` when no
  ``common_ops`` library loads (every one needs ``libcuda``); guarded, it returns ``None``.
  The Qwen2 path on CPU uses none of them (its CPU kernels are gated by AMX support and fall
  back to torch).
- ``torch``: ``torch.get_device_module()`` without a device names the build's accelerator
  (``torch.cuda``), whose ``synchronize`` fails without a driver; SGLang calls it at the end
  of ``release_memory_occupation``. Guarded, it returns ``torch.cpu`` while no GPU is present.
- ``flash_mla`` (installed with SGLang): its loader raises ``OSError`` when ``libcuda`` is
  missing, which megatron-core's optional ``import flash_mla`` (it catches ``ImportError``)
  does not expect; guarded, the error is an ``ImportError``.

On a machine with a GPU every guard is a no-op: the wrapped calls succeed and are returned as
they are.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _guard_ops_loader(module) -> None:
    real = module._load_architecture_specific_ops

    def load_or_none():
        try:
            return real()
        except ImportError:
            return None

    module._load_architecture_specific_ops = load_or_none


def _guard_device_module(torch) -> None:
    real = torch.get_device_module

    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return real(device)

    torch.get_device_module = get_device_module


AFTER_IMPORT = {"sgl_kernel.load_utils": _guard_ops_loader, "torch": _guard_device_module}
OSERROR_AS_IMPORT_ERROR = {"flash_mla"}


class GuardFinder(importlib.abc.MetaPathFinder):
    """Finds the guarded modules as the standard path finder does and wraps their loading."""

    def find_spec(self, name, path, target=None):
        if name not in AFTER_IMPORT and name not in OSERROR_AS_IMPORT_ERROR:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader.exec_module = _guarded_exec(name, spec.loader.exec_module)
        return spec


def _guarded_exec(name: str, real_exec):
    def exec_module(module):
        try:
            real_exec(module)
        except OSError as err:
            if name in OSERROR_AS_IMPORT_ERROR:
                raise ImportError(f"{name} cannot load here: {err}") from err
            raise
        if name in AFTER_IMPORT:
            AFTER_IMPORT[name](module)

    return exec_module


if not any(isinstance(f, GuardFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, GuardFinder())
