"""Test tiers (pyproject markers): unit, dist, e2e, slurm, gpu.

``gpu`` tests are deselected when CUDA is absent. Every test must carry exactly one tier marker.
"""

from __future__ import annotations

import pytest
import torch

TIERS = ("unit", "dist", "e2e", "slurm", "gpu")


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers:
            raise pytest.UsageError(f"{item.nodeid}: mark it with one tier of {TIERS}")
        if "gpu" in tiers and not torch.cuda.is_available():
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
