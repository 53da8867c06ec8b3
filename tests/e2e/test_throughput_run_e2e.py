"""e2e tier: ``benchmarks/throughput_run.py`` (the first-contact check ``throughput_report`` on a
GPU node): its one-GPU overrides make a config that loads. Its CPU run and the ``armor report``
page run in the first contact's rehearsal (``tests/sglang_tier/test_gpu_first_contact.py``).
The tiny artifacts are the tier's (``conftest.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_armor.config import load_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import throughput_run  # noqa: E402

pytestmark = pytest.mark.e2e


def test_the_throughput_runs_gpu_config_loads(tiny_dir, out_dir):
    on_gpu = throughput_run.run_overrides(out_dir, 4, True, tiny_dir)
    config = load_config(throughput_run.CONFIG, on_gpu)  # what the GPU check will run
    assert (config.orchestration.layout, config.resolved.world_size) == ("colocated", 1)
    on_cpu = throughput_run.run_overrides(out_dir, 1, False, tiny_dir)
    rehearsed = load_config(throughput_run.CONFIG, [*on_cpu, *throughput_run.REHEARSAL])
    assert (rehearsed.orchestration.layout, rehearsed.rollout.batch) == ("cpu", 4)
