"""Fixtures of the sglang tier: the real SGLang server on CPU (``sglang_servers.py``).

The tier runs in its own virtualenv (``scripts/sglang_env.sh``: the SGLang pins of
requirements-gpu.txt, requirements.txt and the test-only CPU guards); ``scripts/test.sh`` runs
it after the slurm tier, beside the unit, dist and e2e tiers, with the checkout on
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "e2e")]  # e2e_runs, process_group

from e2e_runs import tiny_artifacts  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny model + data (``armor tiny``; built once per test run: ``tiny_artifacts``)."""
    return tiny_artifacts()


@pytest.fixture(scope="session")
def tiny_moe_dir() -> Path:
    """The tiny mixture-of-experts model + data (``armor tiny --moe``; built once per run)."""
    return tiny_artifacts(moe=True)
