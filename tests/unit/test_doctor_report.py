"""``armor doctor``'s results: statuses, exit code, the fix of a failure, the JSON, bad configs."""

from __future__ import annotations

import json

import pytest

from megatron_armor.cli import main
from megatron_armor.doctor.report import (
    Check,
    CheckFailed,
    NotApplicable,
    exit_code,
    render,
    run_check,
    write_json,
)

pytestmark = pytest.mark.unit


def not_here() -> str:
    raise NotApplicable("no CUDA device")


def wrong_answer() -> str:
    raise CheckFailed("all-reduce gave 2.0, expected 3.0", "rerun with NCCL_DEBUG=INFO")


def crash() -> str:
    return {}["missing"]


def test_outcomes_become_statuses_with_fixes(tmp_path, capsys):
    results = [
        run_check(Check("fine", lambda: "all good", "unused")),
        run_check(Check("gpu", not_here, "unused")),
        run_check(Check("nccl", wrong_answer, "unused")),
        run_check(Check("crash", crash, "reinstall the stack")),
    ]
    assert [r.status for r in results] == ["ok", "n/a", "fail", "fail"]
    assert results[2].fix == "rerun with NCCL_DEBUG=INFO"
    assert results[3].fix == "reinstall the stack" and "KeyError: 'missing'" in results[3].detail
    assert exit_code(results) == 1 and exit_code(results[:2]) == 0
    render(results)
    assert "fix: rerun with NCCL_DEBUG=INFO" in capsys.readouterr().out
    write_json(results, str(tmp_path / "d.json"))
    body = json.loads((tmp_path / "d.json").read_text())
    assert body["ok"] is False and body["checks"][2]["fix"] == "rerun with NCCL_DEBUG=INFO"


def test_bad_config_exits_2_naming_the_setting(capsys):
    assert main(["doctor", "trainer.no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_all_nodes_outside_srun_exits_2_with_the_srun_line(monkeypatch, capsys):
    for key in ("SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    assert main(["doctor", "--all-nodes"]) == 2
    assert "srun --nodes=N --ntasks-per-node=1 armor doctor --all-nodes" in capsys.readouterr().err


def test_a_misspelt_check_exits_2_listing_the_checks(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert main(["doctor", "--all-nodes", "--check", "nccl-typo"]) == 2
    err = capsys.readouterr().err
    assert "--check 'nccl-typo' names no check; the checks: versions, GPUs" in err


def test_slurm_placement_reads_the_task_environment():
    from megatron_armor.doctor.cluster import slurm_placement

    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NODEID": "3", "SLURM_LOCALID": "0",
           "SLURM_JOB_ID": "12345", "MASTER_ADDR": "node01"}  # fmt: skip
    place = slurm_placement(env)
    assert (place.rank, place.world, place.node_id, place.master_addr) == (3, 4, 3, "node01")
    assert place.master_port == 29400 + 345  # two jobs' doctors on one node use two ports
    with pytest.raises(ValueError, match="export MASTER_ADDR"):
        slurm_placement({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
