"""``armor plan --lengths RUN_DIR`` (``planner/tail.py``): the projection of the rollout decode
steps partial rollouts save, from a run's recorded response lengths, on the config's engines
and their KV cache (unit tier: a run directory written here)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_armor.cli import main as armor_main
from megatron_armor.config import load_config
from megatron_armor.planner.tail import (
    expected_makespan,
    makespan,
    project_tail,
    requests_per_engine,
    run_lengths,
)

pytestmark = pytest.mark.unit

LONG_TAIL = [20] * 90 + [80] * 10  # a tenth of the responses four times as long
FOUR_BY_EIGHT = [
    "orchestration.nodes=4", "orchestration.layout=disaggregated", "orchestration.rollout_gpus=16",
    "rollout.sglang.weight_transport=distributed",
]  # fmt: skip


def test_windows_cut_the_wait_for_the_longest():
    """56 requests per engine, all at once: nearly every batch holds a long response (80
    steps); windows of 48 (k=2) and 24 (k=4) tokens bound the wait; a distribution without a
    tail saves nothing."""
    tail = project_tail(LONG_TAIL, 96, 96, 56, slots=56)
    assert tail.synchronous == pytest.approx(80, abs=0.5)
    assert tail.windowed[2] == pytest.approx(48, abs=0.5)
    assert tail.windowed[4] == pytest.approx(24, abs=0.5)
    assert tail.saved(4) == pytest.approx(0.7, abs=0.01)
    flat = project_tail([20] * 100, 96, 96, 56, slots=56)
    assert flat.saved(2) == flat.saved(4) == 0.0
    assert "PROJECTION (not a measurement)" in tail.report()
    assert "max_staleness=4 (window 24 tokens)" in tail.report()


def test_fewer_slots_than_requests_leave_less_of_a_tail():
    """Continuous batching: a freed slot takes the next request, so with 8 slots for 56
    requests the engine is busy with the others while the long ones decode."""
    assert makespan([3, 1, 1, 1], 2) == 3 and makespan([2, 2, 2], 1) == 6 and makespan([], 4) == 0
    few = project_tail(LONG_TAIL, 96, 96, 56, slots=8)
    assert 0 < few.saved(4) < project_tail(LONG_TAIL, 96, 96, 56, slots=56).saved(4)


def test_lengths_scale_to_the_configs_max_new_tokens():
    scaled = project_tail(LONG_TAIL, 96, 960, 56, slots=56)
    assert scaled.synchronous == pytest.approx(800, abs=5)
    assert expected_makespan([3, 5], 4, 4, cap=4) <= 4
    assert expected_makespan([7], 3, 3) == 7.0
    with pytest.raises(ValueError, match="0 lengths"):
        expected_makespan([], 3, 1)


def write_run(run_dir: Path, lengths: list[list[int]], max_new_tokens: int) -> Path:
    """A run directory with one plain and one gzipped anchor file and its config.yaml."""
    (run_dir / "anchors").mkdir(parents=True)
    rows = [json.dumps({"type": "stats", "step": 1})]
    rows += [json.dumps({"type": "query", "policy_lengths": q}) for q in lengths]
    half = len(rows) // 2
    (run_dir / "anchors" / "step_000001.jsonl").write_text("\n".join(rows[:half]) + "\n")
    with gzip.open(run_dir / "anchors" / "step_000002.jsonl.gz", "wt") as f:
        f.write("\n".join(rows[half:]) + "\n")
    (run_dir / "config.yaml").write_text(
        f"rollout:\n  sampling:\n    max_new_tokens: {max_new_tokens}\n"
    )
    return run_dir


def test_the_paper_config_on_4x8_from_a_runs_lengths(tmp_path, capsys):
    """The command of docs/orchestration.md ("Bounded staleness") on the paper's 7B config
    with 16 rollout GPUs: its engines' share of a 2048-query generation batch, as many at a
    time as their KV cache holds, the run's lengths (both anchor files) scaled from 96 to the
    config's 8192 tokens."""
    run = write_run(tmp_path / "run", [LONG_TAIL[i : i + 10] for i in range(0, 100, 10)], 96)
    assert sorted(run_lengths(run)[0]) == sorted(LONG_TAIL) and run_lengths(run)[1] == 96
    config = load_config("configs/paper/qwen25_math_7b_armor.yaml", FOUR_BY_EIGHT)
    assert requests_per_engine(config) == 2048 * 15 // 16  # 15 policy samples, 16 servers
    argv = ["plan", "configs/paper/qwen25_math_7b_armor.yaml", *FOUR_BY_EIGHT,
            "--gpu-mem-gib", "80", "--model", "qwen2.5-math-7b", "--lengths", str(run)]  # fmt: skip
    assert armor_main(argv) == 0
    out = capsys.readouterr().out
    assert "PROJECTION (not a measurement)" in out and "1920 requests per engine" in out
    assert armor_main([*argv, "--json"]) == 0
    tail = json.loads(capsys.readouterr().out)["tail_projection"]
    assert 1 < tail["slots"] < 1920  # the KV cache of one 7B server holds ~100 sequences
    saved = tail["bounded_saved_fraction"]
    assert 0 < saved["2"] < saved["4"] < 1


def test_a_run_without_lengths_is_named(tmp_path, capsys):
    (tmp_path / "anchors").mkdir()
    assert armor_main(["plan", "configs/tiny_cpu.yaml", "--model", "qwen2.5-math-7b",
                       "--lengths", str(tmp_path)]) == 2
    assert f"no response lengths in {tmp_path}/anchors" in capsys.readouterr().err
