"""``armor doctor``'s SGLang check against the real server on CPU (sglang tier): a server
started as the rollout workers start it, one weight update through the configured transport
(``tensor``, the default: the inline CPU payload inside a weight-update session), one
generation, its log-probs against the megatron-core trainer's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sglang_servers import REPO

pytestmark = pytest.mark.sglang


@pytest.mark.timeout(900)
def test_doctor_sglang_check_passes_against_the_real_server(tmp_path):
    out = tmp_path / "doctor.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "megatron_armor.cli", "doctor", "configs/tiny_cpu.yaml",
         "rollout.backend=sglang", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=880,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    check = checks["SGLang + tensor weight update"]
    assert check["status"] == "ok", check
    assert "transport tensor (CPU server)" in check["detail"]
    print(check["detail"])
