"""Dist tier: ``armor doctor --all-nodes`` as ``srun --ntasks-per-node=1`` starts it, two tasks
on this machine (gloo, CPU), each with the environment Slurm gives its task.

- Each task runs its node's checks (``--check versions`` keeps it cheap), then both meet and
  time a cross-node all-reduce; rank 0 prints both nodes' tables and writes the JSON of both
  (the all-reduce's sum checked, its bus bandwidth measured), exit 0 on both.
- One task fails its part of the all-reduce (no such network interface): rank 0 still prints
  both nodes' tables within ``--all-reduce-timeout-s`` (the reports travel over the
  rendezvous store, not the broken group), exit 1 on both.

The refusals outside ``srun`` are unit tests (``tests/unit/test_doctor_report.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_armor.net import free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.dist


def doctor(*argv: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_armor.cli", "doctor", *argv],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def task_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What srun sets for task ``rank`` of a one-task-per-node job (the master given directly:
    no scontrol here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_NODEID": str(rank),
            "SLURM_LOCALID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


@pytest.mark.timeout(300)
def test_two_tasks_meet_and_rank_0_reports_both_nodes(tmp_path):
    port, out = free_port(), tmp_path / "doctor.json"
    tasks = [
        doctor("--all-nodes", "--check", "versions", "--json", str(out), env=task_env(r, 2, port))
        for r in range(2)
    ]
    outputs = [t.communicate(timeout=280)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs
    report = json.loads(out.read_text())
    assert report["ok"] and [n["rank"] for n in report["nodes"]] == [0, 1]
    for node in report["nodes"]:
        status = {c["name"]: (c["status"], c["detail"]) for c in node["checks"]}
        assert list(status) == ["versions", "cross-node all-reduce"], status
        assert status["versions"][0] == "ok"
        state, detail = status["cross-node all-reduce"]
        assert state == "ok" and "2 tasks, 32 MiB gloo all-reduce, bus bandwidth" in detail
    assert "node 1" in outputs[0] and "2 nodes, all ok" in outputs[0], outputs[0]
    assert "node 1" in outputs[1] and "node 0" not in outputs[1]  # each task its own table


@pytest.mark.timeout(300)
def test_a_task_that_fails_its_all_reduce_still_reaches_rank_0s_table(tmp_path):
    """Task 1 cannot open its network interface (``GLOO_SOCKET_IFNAME`` names none: the
    wrong-interface failure the check exists for) and fails its part of the all-reduce; task
    0 waits for it no longer than ``--all-reduce-timeout-s`` and prints both nodes' tables
    from the reports posted to the rendezvous store, task 1's error in it, exit 1 on both."""
    port, out, timeout_s = free_port(), tmp_path / "doctor.json", 10
    envs = [task_env(r, 2, port) for r in range(2)]
    envs[1]["GLOO_SOCKET_IFNAME"] = "armor-no-such-if0"
    argv = ("--all-nodes", "--check", "versions", "--all-reduce-timeout-s", str(timeout_s))
    tasks = [doctor(*argv, "--json", str(out), env=env) for env in envs]
    try:
        outputs = [t.communicate(timeout=timeout_s + 120)[0] for t in tasks]
    finally:
        for task in tasks:
            task.kill()
    assert [t.returncode for t in tasks] == [1, 1], outputs
    report = json.loads(out.read_text())
    assert not report["ok"] and [n["rank"] for n in report["nodes"]] == [0, 1]
    for node in report["nodes"]:
        status = {c["name"]: (c["status"], c["detail"]) for c in node["checks"]}
        assert status["versions"][0] == "ok" and status["cross-node all-reduce"][0] == "fail"
    failed = report["nodes"][1]["checks"][-1]["detail"]
    assert "armor-no-such-if0" in failed, failed  # task 1's own error, read by rank 0
    assert "node 1" in outputs[0] and "failed: " in outputs[0], outputs[0]
