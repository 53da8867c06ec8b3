"""``scripts/gpu_first_contact.sh`` on a machine without a GPU: it says so, writes its report
and exits 0 (the checks themselves: on a GPU node, and rehearsed on CPU by the sglang tier's
``test_gpu_first_contact.py``); a check past its deadline ends the run with the report naming
it. Tier: unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


HUNG = """
import importlib.util, sys, time
import torch
spec = importlib.util.spec_from_file_location("fc", sys.argv[1])
fc = sys.modules["fc"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fc)
fc.CHECKS = [fc.FirstCheck("quick", lambda state: {}, 1, 60),
             fc.FirstCheck("hung", lambda state: time.sleep(600), 1, 1),
             fc.FirstCheck("never", lambda state: {}, 1, 60)]
report = fc.Report(fc.Path(sys.argv[2]), {"checks": {}})
sys.exit(fc.run_checks(report, torch.device("cpu")))
"""


def test_a_check_past_its_deadline_ends_the_run_and_the_report_names_it(tmp_path):
    """A check that hangs (a sleep stands for it) is stopped at its own deadline: exit 1, the
    report keeps the checks before it and names it, the stacks of every thread on stderr."""
    report = tmp_path / "report.json"
    script = REPO / "benchmarks" / "gpu_first_contact.py"
    done = subprocess.run([sys.executable, "-c", HUNG, str(script), str(report)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    got = json.loads(report.read_text())
    assert list(got["checks"]) == ["quick", "hung"] and got["first_broken"] == "hung"
    assert (
        got["checks"]["quick"]["ok"]
        and "over its deadline of 1 s" in got["checks"]["hung"]["error"]
    )
    assert "BROKEN: hung" in done.stderr and "time.sleep" not in done.stdout
