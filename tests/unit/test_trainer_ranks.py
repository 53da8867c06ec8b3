"""``trainer.ranks.run_rank_processes``: every rank runs, a failing rank names itself and its
log tail, a hung rank is killed at the deadline."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_armor.trainer.ranks import run_rank_processes

pytestmark = pytest.mark.unit


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_ranks_run_and_a_failure_names_the_rank_and_its_log(tmp_path):
    logs = [str(tmp_path / f"log{r}.txt") for r in range(2)]
    run_rank_processes([_python("print('ok')")] * 2, logs, dict(os.environ), 60)
    assert [open(p).read() for p in logs] == ["ok\n", "ok\n"]
    commands = [_python("print('fine')"), _python("print('boom'); raise SystemExit(3)")]
    with pytest.raises(RuntimeError, match=r"rank 1 exited with 3:\nboom"):
        run_rank_processes(commands, logs, dict(os.environ), 60)


def test_a_hung_rank_is_killed_at_the_deadline(tmp_path):
    import subprocess

    logs = [str(tmp_path / "log0.txt")]
    with pytest.raises(subprocess.TimeoutExpired):
        run_rank_processes([_python("import time; time.sleep(60)")], logs, dict(os.environ), 1)
