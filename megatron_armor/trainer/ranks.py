"""Run one process per trainer rank to completion, bounded (multi-process CPU checks:
the dist test tier and ``benchmarks/bench_trainer.py``)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def run_rank_processes(
    commands: list[list[str]], log_paths: list[str], env: dict[str, str], timeout_s: float
) -> None:
    """Start ``commands[r]`` with output to ``log_paths[r]`` and wait for every rank within
    ``timeout_s`` in total; on the deadline or any error the ranks still running are killed.
    A rank that exits non-zero raises ``RuntimeError`` with the tail of its log."""
    procs, logs = [], []
    try:
        for command, log_path in zip(commands, log_paths, strict=True):
            log = open(log_path, "w")  # noqa: SIM115 - closed below, after the ranks ended
            logs.append(log)
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            tail = Path(log_paths[rank]).read_text()[-3000:]
            raise RuntimeError(f"rank {rank} exited with {p.returncode}:\n{tail}")
