"""Fixtures of the e2e tier shared by its files: the tiny artifacts, one output directory and
the uninterrupted 4-step ARMOR run that the interrupted and resumed runs are compared with."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_runs import CACHED, Run, tiny_artifacts  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny model + data (built with ``armor tiny`` when missing)."""
    return tiny_artifacts()


@pytest.fixture(scope="session")
def tiny_moe_dir() -> Path:
    """The tiny mixture-of-experts model + data (``armor tiny --moe`` when missing, ~40 s)."""
    return tiny_artifacts(moe=True)


@pytest.fixture(scope="session")
def out_dir():
    path = Path(tempfile.mkdtemp(prefix="armor-e2e-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def reference_run(tiny_dir, out_dir) -> Path:
    """The uninterrupted 4-step ARMOR run every other test compares against."""
    run = Run(out_dir, "uninterrupted", tiny_dir, *CACHED, summary=True)
    code = run.wait()
    assert code == 0, run.output()
    return run.run_dir
