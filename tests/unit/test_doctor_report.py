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
