"""Unit tier: ``armor report`` on a recorded run directory (``fixtures/one_step_run``: the
metrics.jsonl, config.yaml and report_facts.json of a 4-step tiny CPU run with
``orchestration.async_rollout=one_step``, written by ``armor train``): its tables hold the
figures this test recomputes from metrics.jsonl with the published definitions."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from megatron_armor.cli import main as armor_main
from megatron_armor.observability.report import FIGURES, PEER_FIGURES
from megatron_armor.planner.flops import forward_flops
from megatron_armor.planner.model import ModelDims
from megatron_armor.planner.step_phases import STEP_PHASES

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "fixtures" / "one_step_run"


def table(page: str, first_header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header row starts with ``first_header``."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def number(cell: str) -> float:
    return float(re.match(r"[-\d,.]+", cell).group(0).replace(",", ""))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "one_step_run"
    shutil.copytree(FIXTURE, run)
    assert armor_main(["report", str(run)]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["step"] >= 1]
    facts = json.loads((run / "report_facts.json").read_text())
    return run, (run / "report" / "report.md").read_text(), steps, facts


def tokens(r: dict) -> float:
    return r["train/prompt_tokens"] + r["train/response_tokens"]


def test_per_step_table_recomputed_from_metrics(report):
    _, page, steps, facts = report
    rows = table(page, "step")
    assert [int(r[0]) for r in rows] == [r["step"] for r in steps]
    for row, r in zip(rows, steps, strict=True):
        phases = [r[p.metric] for p in STEP_PHASES]
        assert number(row[1]) == pytest.approx(r["timing/step_s"], abs=1e-3)
        assert number(row[2]) == pytest.approx(sum(phases), abs=1e-3)
        assert abs(sum(phases) - r["timing/step_s"]) <= 0.02 * r["timing/step_s"]
        e2e = tokens(r) / r["timing/step_s"] / facts["devices"]  # NeMo-RL's definition
        assert number(row[3]) == pytest.approx(e2e, abs=0.06)
        assert r["perf/e2e_tokens_per_s_per_gpu"] == pytest.approx(e2e)
        assert [number(c) for c in row[4:]] == pytest.approx(phases, abs=1e-3)


def test_phase_table_holds_the_means_shares_and_efficiencies(report):
    _, page, steps, facts = report
    rows = {r[0]: r for r in table(page, "phase")}
    step_s = sum(r["timing/step_s"] for r in steps) / len(steps)
    for phase in STEP_PHASES:
        mean = sum(r[phase.metric] for r in steps) / len(steps)
        assert number(rows[phase.name][1]) == pytest.approx(mean, abs=1e-4)
        assert number(rows[phase.name][2]) == pytest.approx(100 * mean / step_s, abs=0.06)
    assert rows["reward"][5] == "not modelled" and rows["driver"][5] == "not modelled"
    predicted = number(rows["train"][4])
    assert number(rows["train"][5]) == pytest.approx(number(rows["train"][1]) / predicted, rel=0.01)
    # the updates' MFU: model FLOPs (3 x forward) over the summed seconds x ranks x peak
    dims, peak = ModelDims(**facts["model"]), facts["peaks"]["tflops"]["fp32"] * 1e12
    flops = seconds = 0.0
    for r in steps:
        n = r["anchor/kept"] * 4  # algo.group_size of the recorded run
        flops += 3 * n * forward_flops(dims, round(tokens(r) / n))
        seconds += r["phase/train_s"] * 1 * peak
    assert number(rows["train"][3]) == pytest.approx(100 * flops / seconds, abs=0.006)


def test_peers_definitions_and_their_published_figures(report):
    run, page, steps, facts = report
    rows = {r[0]: r for r in table(page, "definition")}
    nemo = sum(tokens(r) / r["timing/step_s"] / facts["devices"] for r in steps) / len(steps)
    assert number(
        rows["NeMo-RL tokens/s/GPU (`perf/e2e_tokens_per_s_per_gpu`)"][1]
    ) == pytest.approx(nemo, abs=0.06)
    assert number(rows["verl `perf/throughput`"][1]) == pytest.approx(nemo, abs=0.06)
    prime = sum(tokens(r) / r["phase/train_s"] for r in steps) / len(steps)
    assert number(rows["prime-rl trainer `perf/throughput` per GPU"][1]) == pytest.approx(
        prime, rel=1e-3
    )
    context = table(page, "framework")
    assert len(context) == len(PEER_FIGURES)
    for row, peer in zip(context, PEER_FIGURES, strict=True):
        assert row[4] == peer.figure and peer.source in row[6] and row[7] == peer.date
    run_rows = {r[0]: r[1] for r in table(page, "what")}
    assert "measured at the run's start" in run_rows["peaks"]
    assert "async_rollout one_step" in run_rows["layout"] and "sha256" in run_rows["config"]
    assert "async/overlap_s" in page  # the rollout beside the updates, outside the sums
    for name in FIGURES:
        png = (run / "report" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_run_without_facts_is_named(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text((FIXTURE / "metrics.jsonl").read_text())
    assert armor_main(["report", str(tmp_path)]) == 2
    assert "report_facts.json is missing" in capsys.readouterr().err
