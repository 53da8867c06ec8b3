"""The signal-lead check (``observability/signal_lead.py``): a step plus a checkpoint longer than
the lead ``slurm/armor.sbatch`` exports is said once, after the first steps. Tier: unit."""

from __future__ import annotations

import pytest

from megatron_armor.observability.signal_lead import LEAD_ENV, SignalLeadWatch, p95

pytestmark = pytest.mark.unit


def test_p95_is_the_nearest_rank():
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([3.0]) == 3.0


def test_the_warning_comes_once_after_the_first_steps_and_a_checkpoint():
    watch = SignalLeadWatch(lead_s=120.0)
    said = [watch.observe(100.0, None) for _ in range(5)]  # no checkpoint yet: nothing known
    said.append(watch.observe(100.0, 30.0))  # 100 + 30 > 120
    assert said[:5] == [None] * 5
    assert "a step takes up to 100 s (p95 of 6) and a checkpoint 30 s" in said[5]
    assert "more than the 120 s" in said[5] and f"{LEAD_ENV}=195" in said[5]
    assert watch.observe(500.0, 30.0) is None  # once


def test_a_run_that_fits_or_runs_outside_the_sbatch_file_is_quiet(monkeypatch):
    fits = SignalLeadWatch(lead_s=600.0)
    assert all(fits.observe(100.0, 30.0) is None for _ in range(20))
    monkeypatch.delenv(LEAD_ENV, raising=False)
    assert SignalLeadWatch.from_environment().lead_s is None
    monkeypatch.setenv(LEAD_ENV, "900")
    assert SignalLeadWatch.from_environment().lead_s == 900.0
