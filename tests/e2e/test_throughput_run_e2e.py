"""e2e tier: ``benchmarks/throughput_run.py`` (the first-contact check ``throughput_report`` on a
GPU node) trains the tiny config on CPU and writes its ``armor report`` page; its one-GPU
overrides make a config that loads. The tiny artifacts are the tier's (``conftest.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_armor.config import load_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import throughput_run  # noqa: E402

pytestmark = pytest.mark.e2e

SHORT = ("algo.group_size=4", "algo.ref_n=2", "rollout.batch=4", "rollout.gen_batch=8",
         "trainer.ppo_mini_batch=2", "validation.n_samples=2", "validation.max_problems=8")  # fmt: skip


@pytest.mark.timeout(900)
def test_the_throughput_run_trains_and_writes_its_page(tiny_dir, out_dir, monkeypatch):
    monkeypatch.setenv("ARMOR_TINY_DIR", str(tiny_dir))
    on_gpu = throughput_run.run_overrides(out_dir, 4, True, tiny_dir)
    config = load_config(throughput_run.CONFIG, on_gpu)  # what the GPU check will run
    assert (config.orchestration.layout, config.trainer.world_size) == ("colocated", 1)
    got = throughput_run.train_and_report(out_dir / "throughput_cpu", 1, False, 600, SHORT)
    assert got["steps"] == 1 and got["e2e_tokens_per_s_per_gpu_mean"] > 0
    page = Path(got["report"]).read_text()
    assert "## Throughput in the peers' definitions" in page and "| 1 |" in page
    for png in ("phases.png", "tokens_per_s_per_gpu.png", "predicted_vs_measured.png"):
        assert (Path(got["run_dir"]) / "report" / png).stat().st_size > 5000
