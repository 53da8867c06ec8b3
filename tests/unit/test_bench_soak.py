"""``benchmarks/bench_soak.py``'s report of a run's metrics: memory and disk growth per 100
steps, step-time drift, acceptance per tenth of the run, warnings, finished or not. Tier: unit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(steps: int = 200) -> list[dict]:
    """Step 0 (validation only), then: memory +0.5 GB per 100 steps, a checkpoint every 50
    steps (the run dir +0.1 GB each), step time 1 s rising to 2 s, acceptance 0.5 -> 0.1."""
    out = [{"step": 0, "val/tiny/avg@4": 0.2}]
    for s in range(1, steps + 1):
        r = {"step": s, "mem/run_gb": 2.0 + 0.005 * s, "mem/driver_gb": 0.5,
             "timing/step_s": 1.0 + s / steps, "anchor/acceptance_rate": 0.5 - 0.4 * s / steps,
             "anchor/gen_batches": 1.0 + 3 * s / steps, "anchor/short_batch": float(s > 180),
             "watch/acceptance_warning": float(s >= 150)}  # fmt: skip
        if s % 50 == 0:
            r.update({"disk/run_dir_gb": 0.1 * s / 50, "disk/checkpoint_gb": 0.05,
                      "timing/checkpoint_s": 5.0, "timing/step_s": r["timing/step_s"] + 5.0})  # fmt: skip
        if s % 100 == 0:
            r["val/tiny/avg@4"] = 0.2 + s / 1000
        out.append(r)
    return out


def test_the_report_measures_growth_drift_acceptance_and_warnings(soak):
    rep = soak.report(records(), 200)
    assert rep["finished"] and rep["last_step"] == 200 and rep["short_batches"] == 20
    mem = rep["memory"]["mem/run_gb"]
    assert mem["per_100"] == pytest.approx(0.5) and mem["per_100_second_half"] == pytest.approx(0.5)
    assert (mem["first"], mem["last"]) == (pytest.approx(2.005), pytest.approx(3.0))
    assert rep["memory"]["mem/driver_gb"]["per_100"] == pytest.approx(0.0)
    assert rep["memory"]["mem/trainer0_gb"] == {}  # not logged: left out
    disk = rep["disk"]
    assert disk["per_100"] == pytest.approx(0.2) and disk["checkpoint_gb"] == 0.05
    times = rep["step_time"]  # the checkpoint seconds are taken out
    assert len(times["median_per_part"]) == 10 and times["per_100"] == pytest.approx(0.5)
    assert times["drift"] == pytest.approx(
        times["median_per_part"][-1] / times["median_per_part"][0]
    )
    assert 1.8 < times["drift"] < 1.9
    parts = rep["acceptance"]
    assert [p["steps"] for p in parts[:2]] == [[1, 20], [21, 40]] and parts[-1]["short"] == 20
    assert parts[0]["acceptance"] == pytest.approx(0.5 - 0.4 * 10.5 / 200)
    assert rep["warnings"]["acceptance"] == {"steps_on": 51, "first": 150}
    assert rep["warnings"]["memory"] == {"steps_on": 0, "first": None}
    val = rep["validation"]["val/tiny/avg@4"]
    assert [s for s, _ in val] == [0, 100, 200] and [v for _, v in val] == pytest.approx(
        [0.2, 0.3, 0.4]
    )
    text = soak.markdown(rep)
    assert "| `mem/run_gb` | 2.005 | 3.000 | 3.000 | +0.5000 | +0.5000 |" in text
    assert "finished: True (last step 200 of 200" in text and "acceptance on 51 steps" in text


def test_a_run_that_died_is_not_finished(soak):
    rep = soak.report(records(120), 200)
    assert not rep["finished"] and rep["last_step"] == 120
    assert "finished: False (last step 120 of 200" in soak.markdown(rep)
