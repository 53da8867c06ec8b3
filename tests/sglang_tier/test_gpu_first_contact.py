"""``scripts/gpu_first_contact.sh --rehearse`` (sglang tier: the GPU stack's pins minus
Transformer Engine, so the ``gpu`` tests it names collect as on a GPU node): every check in
order on CPU, each within its deadline, the report rewritten after each one, with neither the
network nor a package index (a proxy that refuses every connection, pip without an index)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]


def first_contact():
    """``benchmarks/gpu_first_contact.py`` as a module (its checks and budgets)."""
    path = REPO / "benchmarks" / "gpu_first_contact.py"
    spec = importlib.util.spec_from_file_location("_armor_first_contact", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def offline_env() -> dict[str, str]:
    """This environment without the network: every HTTP(S) request not to this machine goes
    to a port nothing listens on, pip has no index, the hub is offline."""
    refused = "http://127.0.0.1:9"
    return {**os.environ, "ARMOR_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1",
            "PIP_NO_INDEX": "1", "http_proxy": refused, "https_proxy": refused,
            "HTTP_PROXY": refused, "HTTPS_PROXY": refused,
            "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost"}  # fmt: skip


@pytest.mark.timeout(900)
def test_the_rehearsal_runs_every_check_in_order_within_its_deadline(tmp_path):
    fc = first_contact()
    names = [c.name for c in fc.CHECKS]
    assert fc.H100_BUDGET_S == sum(c.h100_budget_s for c in fc.CHECKS) <= 8 * 60
    out = tmp_path / "report.json"
    script = REPO / "scripts" / "gpu_first_contact.sh"
    proc = subprocess.Popen(["bash", str(script), "--rehearse", "--out", str(out)],
                            env=offline_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        passed = re.match(r"first contact: (\w+): ok in", line)
        if passed:  # the report already holds the check it prints
            assert json.loads(out.read_text())["checks"][passed.group(1)]["ok"] is True
            seen.append(passed.group(1))
    assert proc.wait(timeout=60) == 0, "".join(lines[-60:])
    report = json.loads(out.read_text())
    assert seen == names and list(report["checks"]) == names
    assert report["rehearsal"] and not report["gpu"]
    assert report["h100_budget_s"] == {**{c.name: c.h100_budget_s for c in fc.CHECKS},
                                       "total": fc.H100_BUDGET_S}  # fmt: skip
    for name, entry in report["checks"].items():
        assert entry["ok"] and entry["seconds"] <= entry["deadline_s"], (name, entry)
    assert report["checks"]["gpu_tests"]["collected"] >= len(fc.GPU_TESTS)
    run = report["checks"]["throughput_report"]  # the tiny config's page of its one step
    assert run["steps"] == 1 and run["e2e_tokens_per_s_per_gpu_mean"] > 0
    page = Path(run["report"]).read_text()
    assert "## Throughput in the peers' definitions" in page and "| 1 |" in page
    for png in ("phases.png", "tokens_per_s_per_gpu.png", "predicted_vs_measured.png"):
        assert (Path(run["run_dir"]) / "report" / png).stat().st_size > 5000
    print("rehearsal:", {n: report["checks"][n]["seconds"] for n in names})
