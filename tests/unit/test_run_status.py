"""The step line's throughput and ETA, and ``armor status RUN_DIR`` on a run directory written
by the test (config.yaml, metrics.jsonl, checkpoints/).

Tier: unit (files only; no Ray, no model).
"""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from megatron_armor.cli import main
from megatron_armor.config import load_config
from megatron_armor.observability.status import StepClock, format_duration, status_lines
from megatron_armor.observability.summary import step_line

pytestmark = pytest.mark.unit


def test_step_clock_eta_is_the_recent_mean_times_the_steps_left():
    clock = StepClock(window=2)
    assert clock.eta(0, 10) is None
    for seconds in (100.0, 10.0, 30.0):  # the first leaves the window
        clock.observe(seconds)
    assert clock.eta(7, 10) == pytest.approx(60.0)
    assert clock.eta(10, 10) == 0.0


@pytest.mark.parametrize(
    ("seconds", "text"), [(5, "5s"), (93, "1m33s"), (5400, "1h30m"), (200000, "2d07h")]
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_step_line_shows_throughput_and_eta():
    m = {
        "perf/rollout_tokens_per_s": 12345.0,
        "perf/train_tokens_per_s": 950.0,
        "timing/step_s": 4.0,
    }
    line = step_line(3, 10, m, eta_s=28.0)
    assert "gen 12.3k tok/s, train 950 tok/s | 4.0s | ETA 28s" in line
    assert "ETA" not in step_line(10, 10, m, eta_s=0.0)


def write_run(run_dir, steps: int = 10) -> None:
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000002" / "manifest.json").write_text('{"files": {}}')
    (run_dir / "checkpoints" / "step_000004").mkdir()  # a save cut short: no manifest
    best = {"step": 2, "metric": "val/aime24/avg@4", "value": 0.5, "mode": "max"}
    (run_dir / "checkpoints" / "best.json").write_text(json.dumps(best))
    config = load_config(None, [f"run.steps={steps}"])
    OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")
    records = [{"step": 0, "wall_time": 1000.0, "val/aime24/avg@4": 0.25}]
    for step in range(1, 5):
        records.append({"step": step, "wall_time": 1000.0 + 60 * step, "timing/step_s": 60.0,
                        "perf/rollout_tokens_per_s": 2000.0, "perf/train_tokens_per_s": 5000.0})  # fmt: skip
    records[2]["val/aime24/avg@4"] = 0.5
    records[4].update({"watch/acceptance_warning": 1.0, "watch/memory_warning": 0.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "wandb_run_id").write_text("abc123\n")


def test_armor_status_reads_the_run_directory(tmp_path, capsys):
    write_run(tmp_path)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 4/10 (40%)" in out
    assert "ETA 6m00s (60.0 s last step)" in out  # 6 steps x 60 s
    assert "throughput: gen 2.0k tok/s, train 5.0k tok/s" in out
    assert "validation (step 2): aime24/avg@4 0.500" in out
    assert "warnings: acceptance trend" in out
    assert f"newest checkpoint: {tmp_path / 'checkpoints' / 'step_000002'}" in out
    assert "best checkpoint: step 2 (val/aime24/avg@4 0.5000)" in out
    assert "W&B run id: abc123" in out


def test_status_lines_before_the_first_step_and_without_warnings():
    assert status_lines([], 10, [], None) == ["no step logged yet"]
    lines = status_lines([{"step": 0, "wall_time": 0.0}], 10, [], None, now=90.0)
    assert lines[0] == "step 0/10 (0%), logged 1m30s ago"
    assert "warnings: none" in lines and "newest checkpoint: none yet" in lines


def test_armor_status_of_a_directory_without_a_run_exits_2(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "no config.yaml; not a run directory" in capsys.readouterr().err
