"""``armor doctor`` on a CPU machine (CI): the table and the JSON list every check, the GPU
ones as ``n/a`` with the reason, and a real one-update megatron-core trainer step on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU_CHECKS = ("GPUs", "pinned GPU stack", "TE FP8 GEMM (delayed)", "CUDA IPC (2 processes)",
              "NCCL all-reduce", "SGLang + tensor weight update")  # fmt: skip

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU listing; GPUs run the real checks")
@pytest.mark.timeout(240)
def test_doctor_on_cpu_prints_table_and_json(tmp_path):
    out = tmp_path / "doctor.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "megatron_armor.cli", "doctor", "configs/tiny_cpu.yaml",
         "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert report["ok"] and status["versions"] == "ok" and status["trainer step"] == "ok"
    assert all(status[name] == "n/a" for name in GPU_CHECKS), status
    by_name = {c["name"]: c for c in report["checks"]}
    assert "no CUDA device" in by_name["NCCL all-reduce"]["detail"]
    assert "grad norm" in by_name["trainer step"]["detail"]
    assert "megatron-core 0.16.1" in by_name["versions"]["detail"]
    for name in ("armor doctor", "trainer step", "NCCL all-reduce", "n/a"):
        assert name in run.stdout
