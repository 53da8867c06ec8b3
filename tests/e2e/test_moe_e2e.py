"""e2e tier: the tiny mixture-of-experts run (``configs/tiny_moe_cpu.yaml``) end to end, then
``kill -9`` and an exact resume.

The tiny Qwen3-MoE (``armor tiny --moe``: 4 experts, top-2, built once, or reused from
``$ARMOR_TINY_MOE_DIR`` / ``artifacts/tiny_moe``) trains on two CPU ranks with expert
parallelism 2 (each rank holds 2 of every layer's experts; megatron-core's all-to-all over
gloo), the embedded engine sampling, the e2e runs' 4 steps with resets and checkpoints every 2
and cached anchors (a cached anchor keeps the routes the reference engine chose).
``orchestration.async_rollout=one_step`` is refused here: two trainer ranks and the engine
need three cores; its batch in flight keeps the samples' routes through the checkpoint
(``tests/unit/test_async_rollout.py``).

1. The uninterrupted run: 4 steps; the engine's log-probs of the samples equal the trainer's
   ``old`` pass (the experts' weights reach the engine after every step and at the reset);
   with ``trainer.moe.routing_replay: r3`` (the config's) the engine's routes reach the
   trainer (its routing agreement with them is logged every step).
2. ``kill -9`` of the run's process group once step 2's checkpoint is committed (its
   ``meta.json``: a file, not a clock); ``--resume auto`` gives every non-timing metric of
   the uninterrupted run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_armor.config.moe import wants_engine_routes
from megatron_armor.observability.metrics import read_metrics, without_wall_clock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_runs import CACHED, Run  # noqa: E402

pytestmark = pytest.mark.e2e

MOE = CACHED


def moe_run(out_dir: Path, name: str, tiny: Path) -> Run:
    return Run(out_dir, name, tiny, *MOE, config="tiny_moe_cpu.yaml")


def metrics_of(run_dir: Path) -> list[dict]:
    return [without_wall_clock(r) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def moe_uninterrupted(tiny_moe_dir, out_dir) -> Path:
    run = moe_run(out_dir, "moe", tiny_moe_dir)
    assert run.wait() == 0, run.output()
    return run.run_dir


@pytest.mark.timeout(900)
def test_moe_run_with_expert_parallelism_then_kill_9_and_exact_resume(
    moe_uninterrupted, tiny_moe_dir, out_dir
):
    from megatron_armor.config.loader import load_config

    lines = {r["step"]: r for r in read_metrics(moe_uninterrupted)}
    assert sorted(lines) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # the engine serves the trainer's experts (fp32 rounding)
        assert lines[step]["rollout/policy_logprob_absdiff_max"] <= 1e-3, step
        assert lines[step]["rollout/anchor_logprob_absdiff_max"] <= 1e-3, step
    config = load_config(str(moe_uninterrupted / "config.yaml"), [])
    assert (config.trainer.ep, config.trainer.world_size) == (2, 2)
    if wants_engine_routes(config):  # the engine's routes reached the trainer's old pass
        assert all("moe/route_agree_policy" in lines[s] for s in (1, 2, 3, 4))
    assert [r["reset/performed"] for r in map(lines.get, (1, 2, 3, 4))] == [0.0, 1.0, 0.0, 1.0]

    first = moe_run(out_dir, "moe_killed", tiny_moe_dir)
    committed = first.run_dir / "checkpoints" / "step_000002" / "meta.json"
    first.wait_for(committed.is_file)
    first.kill_group()
    second = moe_run(out_dir, "moe_killed", tiny_moe_dir)
    assert second.wait() == 0, second.output()
    assert f"resumed from {committed.parent}" in second.text()
    assert metrics_of(second.run_dir) == metrics_of(moe_uninterrupted)
