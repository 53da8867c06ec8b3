"""``scripts/gpu_first_contact.sh`` on a machine without a GPU: it says so, writes its report
and exits 0 (the GPU checks themselves run on a GPU node, docs/gpu.md). Tier: unit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def test_without_a_gpu_the_first_contact_says_so_and_exits_0(tmp_path):
    report = tmp_path / "report.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, also on a GPU machine
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_first_contact.sh"), "--out", str(report)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no GPU" in done.stdout
    got = json.loads(report.read_text())
    assert got["gpu"] is False and got["checks"] == {} and "nothing to check" in got["message"]
