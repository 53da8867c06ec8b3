"""Test tiers (pyproject markers): unit, dist, e2e, slurm, sglang, gpu.

``gpu`` tests are deselected when CUDA is absent, ``sglang`` tests where SGLang is not
installed (they run in the sglang tier's own virtualenv: ``scripts/test.sh``,
``scripts/sglang_env.sh``). Every test must carry exactly one tier marker.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

TIERS = ("unit", "dist", "e2e", "slurm", "sglang", "gpu")


def sglang_installed() -> bool:
    """Whether the SGLang distribution is installed here (its metadata: a module named
    ``sglang`` could be something else on the path)."""
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def runs_here(tiers: list[str]) -> bool:
    """Whether this machine and environment can run a test of ``tiers``."""
    if "gpu" in tiers and not torch.cuda.is_available():
        return False
    return "sglang" not in tiers or sglang_installed()


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers:
            raise pytest.UsageError(f"{item.nodeid}: mark it with one tier of {TIERS}")
        if runs_here(tiers):
            keep.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
