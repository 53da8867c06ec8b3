"""Test tiers (pyproject markers): unit, dist, e2e, slurm, sglang, gpu.

Every test carries the tier it runs in on CPU (``unit``, ``dist``, ``e2e``, ``slurm``,
``sglang``). ``gpu`` marks a test with a GPU path, written once for the :func:`device` fixture:
with CUDA it runs there, and on CPU it runs in its other tier every CI run, where only the
lines that need CUDA are left out (:func:`cuda_only`, each with its reason in the summary). A
test marked ``gpu`` alone needs CUDA in every line: it is skipped without CUDA with its reason
(docs/gpu.md, "The gpu test tier", lists them). ``sglang`` tests are deselected where SGLang
is not installed (they run in the sglang tier's own virtualenv: ``scripts/test.sh``,
``scripts/sglang_env.sh``).

``own_process``: the module's tests run in one pytest process of their own (a trainer rank in
the test process would switch it to megatron-core's CPU mode and hold its process groups for
the tests after it); their results are reported here as if run here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

TIERS = ("unit", "dist", "e2e", "slurm", "sglang", "gpu")
CUDA_ONLY_REASON = "every line needs CUDA (docs/gpu.md, 'The gpu test tier')"
OWN_PROCESS_ENV = "PYTEST_OWN_PROCESS_REPORT"  # the tests' own, not an armor setting
"""Set in an ``own_process`` child: where it writes its test reports (JSON lines)."""
OWN_PROCESS_TIMEOUT_S = 3600


def sglang_installed() -> bool:
    """Whether the SGLang distribution is installed here (its metadata: a module named
    ``sglang`` could be something else on the path)."""
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def runs_here(tiers: list[str]) -> bool:
    """Whether this environment can run a test of ``tiers`` (a ``gpu`` test with a CPU tier
    runs on CPU; one marked ``gpu`` alone is skipped there, not deselected)."""
    return "sglang" not in tiers or sglang_installed()


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    cuda = torch.cuda.is_available()
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if not tiers:
            raise pytest.UsageError(f"{item.nodeid}: mark it with one tier of {TIERS}")
        if tiers == ["gpu"] and not cuda:
            item.add_marker(pytest.mark.skip(reason=CUDA_ONLY_REASON))
        if runs_here(tiers):
            keep.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def device() -> torch.device:
    """What a ``gpu`` test runs on: ``cuda`` where CUDA is available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def cuda_only(request, device):
    """``cuda_only(reason)``: whether the lines that need CUDA run here (the caller runs them
    under ``if``); on CPU ``False``, and ``reason`` goes into the run's summary."""

    def here(reason: str) -> bool:
        if device.type == "cuda":
            return True
        request.node.user_properties.append(("cuda_only", reason))
        return False

    return here


def pytest_terminal_summary(terminalreporter):
    """The CUDA-only parts left out of the ``gpu`` tests that ran on CPU, with their reasons."""
    lines = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, reason in getattr(report, "user_properties", []):
                if key == "cuda_only" and getattr(report, "when", "") == "call":
                    lines.append(f"{report.nodeid}: {reason}")
    if lines:
        terminalreporter.section("CUDA-only parts left out on CPU")
        for line in sorted(set(lines)):
            terminalreporter.line(line)


# ---------------------------------------------------------------------- own_process modules
def pytest_runtest_logreport(report):
    """In an ``own_process`` child: every report, for the parent to show."""
    path = os.environ.get(OWN_PROCESS_ENV)
    if not path:
        return
    body = {
        "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
        "longrepr": report.longreprtext if report.failed else _skip_reason(report),
        "duration": report.duration, "sections": list(report.sections),
        "user_properties": [list(p) for p in report.user_properties],
    }  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(body) + "\n")


def _skip_reason(report):
    """A skip's ``(file, line, reason)`` (what pytest's summary prints), else ``None``."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return list(report.longrepr)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """An ``own_process`` test: its module's selected tests run once in a child pytest (at the
    module's first test), and each test's reports from there are reported here."""
    if item.get_closest_marker("own_process") is None or os.environ.get(OWN_PROCESS_ENV):
        return None
    reports = _module_reports(item)
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    mine = reports.get(item.nodeid) or [_missing(item)]
    for body in mine:
        item.ihook.pytest_runtest_logreport(report=_report(item, body))
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _module_reports(item) -> dict[str, list[dict]]:
    """``{nodeid: [report]}`` of the child pytest that ran ``item``'s module (run once)."""
    cache = item.session.stash.setdefault(_OWN_REPORTS, {})
    module = item.module.__file__
    if module in cache:
        return cache[module]
    ids = [i.nodeid for i in item.session.items
           if i.module.__file__ == module and i.get_closest_marker("own_process")]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="armor-own-process-") as tmp:
        out = Path(tmp) / "reports.jsonl"
        env = dict(os.environ, **{OWN_PROCESS_ENV: str(out)})
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids]
        try:
            done = subprocess.run(cmd, cwd=item.config.rootpath, env=env, capture_output=True,
                                  text=True, timeout=OWN_PROCESS_TIMEOUT_S)  # fmt: skip
            tail = done.stdout[-4000:] + done.stderr[-4000:]
        except subprocess.TimeoutExpired as err:
            tail = f"the module's own pytest process ran over {OWN_PROCESS_TIMEOUT_S} s: {err}"
        lines = out.read_text().splitlines() if out.exists() else []
    reports: dict[str, list[dict]] = {}
    for line in lines:
        body = json.loads(line)
        reports.setdefault(body["nodeid"], []).append(body)
    for nodeid in ids:
        if nodeid not in reports:
            reports[nodeid] = [{"nodeid": nodeid, "when": "call", "outcome": "failed",
                                "longrepr": f"no report from its own process:\n{tail}",
                                "duration": 0.0, "sections": [], "user_properties": []}]  # fmt: skip
    cache[module] = reports
    return reports


_OWN_REPORTS = pytest.StashKey[dict]()


def _missing(item) -> dict:
    return {"nodeid": item.nodeid, "when": "call", "outcome": "failed",
            "longrepr": "no report from its own process", "duration": 0.0, "sections": [],
            "user_properties": []}  # fmt: skip


def _report(item, body: dict) -> pytest.TestReport:
    longrepr = body["longrepr"]
    if body["outcome"] == "skipped" and isinstance(longrepr, list):
        longrepr = tuple(longrepr)
    return pytest.TestReport(
        item.nodeid, item.location, {}, body["outcome"], longrepr, body["when"],
        sections=[tuple(s) for s in body["sections"]], duration=body["duration"],
        user_properties=[tuple(p) for p in body["user_properties"]],
    )  # fmt: skip
