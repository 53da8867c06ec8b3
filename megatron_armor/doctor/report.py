"""Check results of ``armor doctor``: run a check, render the table, write the JSON.

A check is a function returning a detail string (status ``ok``); it raises
:class:`NotApplicable` when the node cannot run it (no GPU, no SGLang: status ``n/a`` with the
reason) and :class:`CheckFailed` (or any exception) when it fails (status ``fail``, with the fix).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

OK, FAIL, NOT_APPLICABLE = "ok", "fail", "n/a"


class NotApplicable(Exception):
    """The check does not apply on this node; the message says why."""


class CheckFailed(Exception):
    """The check ran and failed; ``fix`` says what to do."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], str]
    fix: str
    """What to do when the check raises something other than :class:`CheckFailed`."""


def run_check(check: Check) -> CheckResult:
    """Run ``check``; every outcome becomes a :class:`CheckResult`."""
    start = time.monotonic()
    try:
        status, detail, fix = OK, check.run(), ""
    except NotApplicable as reason:
        status, detail, fix = NOT_APPLICABLE, str(reason), ""
    except CheckFailed as failure:
        status, detail, fix = FAIL, str(failure), failure.fix
    except Exception as err:  # noqa: BLE001 - any crash of a check is that check's failure
        last = traceback.extract_tb(err.__traceback__)[-1]
        status, fix = FAIL, check.fix
        detail = (
            f"{type(err).__name__}: {str(err)[:600]} ({Path(last.filename).name}:{last.lineno})"
        )
    return CheckResult(check.name, status, detail, fix, round(time.monotonic() - start, 2))


def exit_code(results: list[CheckResult]) -> int:
    """1 when any check failed, else 0 (``n/a`` is not a failure)."""
    return int(any(r.status == FAIL for r in results))


def render(results: list[CheckResult], title: str = "armor doctor") -> None:
    """A rich table: check, status, detail (and the fix of each failure)."""
    from rich.console import Console
    from rich.table import Table

    colours = {OK: "green", FAIL: "bold red", NOT_APPLICABLE: "yellow"}
    table = Table(title=title, show_lines=True)
    for column in ("check", "status", "seconds", "detail / fix"):
        table.add_column(column, overflow="fold")
    for r in results:
        text = r.detail + (f"\nfix: {r.fix}" if r.fix else "")
        status = f"[{colours[r.status]}]{r.status}[/]"
        table.add_row(r.name, status, f"{r.seconds:.1f}", text)
    Console(width=160).print(table)


def write_json(results: list[CheckResult], path: str) -> None:
    """``{"ok": bool, "checks": [{name, status, detail, fix, seconds}, ...]}`` at ``path``."""
    body = {"ok": exit_code(results) == 0, "checks": [asdict(r) for r in results]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(body, indent=2) + "\n")


def write_nodes_json(nodes: list, path: str) -> None:
    """``{"ok": bool, "nodes": [{host, node_id, rank, ok, checks}, ...]}`` at ``path``
    (``armor doctor --all-nodes``; ``nodes``: ``doctor.cluster.NodeReport``)."""
    body = {"ok": all(n.ok for n in nodes), "nodes": [n.to_dict() for n in nodes]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(body, indent=2) + "\n")
