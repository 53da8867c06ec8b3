"""e2e tier: `armor compare` on a 2-variant x 2-seed tiny spec, killed and resumed.

Variants: the referee's filter control with ARMOR's ``n_on = G - 1`` on-policy samples (its
reference samples drawn with the ``swap`` strategy: the reference weights loaded into the
engine and the policy weights put back), and DAPO with QUATRO's advantage (so QUATRO trains
end to end here). Their groups are those of docs/algorithm.md, anchor rollout, for
``anchor: filter_only`` and ``anchor: none``: no anchor inserted. Each run is 2 steps with a
checkpoint every step. Runs go seed-major (filter_g1/seed_1, quatro/seed_1, then seed 2).
The comparison is ``kill -9``-ed (its whole process group and its Ray processes) once the
second run has written its step-1 checkpoint; the rerun skips the finished first run,
resumes the second from that checkpoint, runs the rest and writes the report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics
from megatron_armor.orchestration.step.step_metrics import read_anchor_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_runs import REPO, Run  # noqa: E402 (tiny_dir: a fixture of conftest.py)

pytestmark = pytest.mark.e2e

TIMEOUT_S = 600


def write_spec(out: Path, tiny: Path) -> Path:
    spec = {
        "name": "e2e", "output_dir": str(out), "config": str(REPO / "configs" / "tiny_cpu.yaml"),
        "seeds": [1, 2],
        "overrides": [
            "run.steps=2", "run.ckpt_every=1", "algo.group_size=4", "algo.ref_n=2",
            "algo.reset.schedule=none", "rollout.batch=4", "rollout.gen_batch=8",
            "trainer.ppo_mini_batch=4", "validation.every=2", "validation.max_problems=8",
            "validation.n_samples=2", "logging.progress=false", "logging.exact_kl_every=1",
            f"trainer.model_path={tiny / 'model'}",
            f"data.train_files=[{tiny / 'data' / 'train.parquet'}]",
            f"data.val_files=[{tiny / 'data' / 'val.parquet'}]",
        ],
        "variants": {
            "filter_g1": ["algo.anchor=filter_only", "algo.ratio=standard",
                          "algo.filter_policy_samples=G-1", "rollout.ref_strategy=swap"],
            "quatro": ["algo.anchor=none", "algo.ratio=standard", "algo.advantage=quatro"],
        },
        "pairs": [["filter_g1", "quatro"]],
    }  # fmt: skip
    path = out / "spec.yaml"
    path.write_text(json.dumps(spec))
    return path


class Compare(Run):
    """One `armor compare` subprocess in its own process group and Ray temp dir (``Run``'s
    waiting, ``kill -9`` and clean-up)."""

    def __init__(self, spec: Path, log: Path):  # noqa: D107 (Run.__init__ starts a train run)
        self.ray_tmp = tempfile.mkdtemp(prefix="arc", dir="/tmp")
        self.log = log.open("w")
        env = dict(os.environ, RAY_TMPDIR=self.ray_tmp, RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(REPO))  # fmt: skip
        cmd = [sys.executable, "-m", "megatron_armor.cli", "compare", str(spec)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def query_ids_of_first_batch(run_dir: Path) -> list[str]:
    rows = read_anchor_file(run_dir, 1)
    return [r["query_id"] for r in rows if r.get("type") == "query" and r["gen_batch"] == 0]


def kept_groups(run_dir: Path) -> list[dict]:
    return [x for x in read_anchor_file(run_dir, 1) if x.get("kept")]


def assert_group_composition(run_dir: Path, policy_n: int, ref_n: int) -> None:
    """Step 1's 4 kept groups: ``policy_n`` on-policy and ``ref_n`` reference samples, no anchor;
    the engine's policy log-probs are the trainer's."""
    kept = kept_groups(run_dir)
    assert len(kept) == 4, kept
    assert all(x["policy_n"] == policy_n and "anchor_len" not in x for x in kept), kept
    assert all(x["ref_n"] == ref_n for x in kept), kept
    record = read_metrics(run_dir)[-1]
    assert record.get("length/anchor_mean") is None
    assert record["rollout/policy_logprob_absdiff_max"] < 1e-3


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_compare_runs_resumes_after_kill_and_reports(tiny_dir):
    out = Path(tempfile.mkdtemp(prefix="armor-compare-e2e-"))
    try:
        spec = write_spec(out, tiny_dir)
        root = out / "e2e"
        second = root / "quatro" / "seed_1"
        first = Compare(spec, out / "first.log")
        first.wait_for(
            lambda: (second / "checkpoints" / "step_000001" / "meta.json").is_file(), TIMEOUT_S
        )
        first.kill_group()
        assert (root / "filter_g1" / "seed_1" / "checkpoints" / "step_000002").is_dir()
        assert not (second / "checkpoints" / "step_000002").exists()

        rerun = Compare(spec, out / "rerun.log")
        assert rerun.wait(timeout=TIMEOUT_S) == 0, rerun.output()
        log = rerun.output()
        assert "filter_g1/seed_1" not in log, log  # finished before the kill: skipped
        assert "quatro/seed_1: resuming" in log and "quatro/seed_2: done" in log

        steps = [r["step"] for r in read_metrics(second)]
        assert steps == [0, 1, 2], steps  # resumed after step 1, nothing repeated
        for variant in ("filter_g1", "quatro"):
            for seed in (1, 2):
                run = root / variant / f"seed_{seed}"
                assert (run / "checkpoints" / "step_000002" / "meta.json").is_file()
        # same data order per seed across variants; filter_g1 draws G - 1 on-policy samples
        f1, q1 = root / "filter_g1" / "seed_1", root / "quatro" / "seed_1"
        assert query_ids_of_first_batch(f1) == query_ids_of_first_batch(q1)
        rows = read_anchor_file(f1, 1)
        assert {r["policy_n"] for r in rows if r.get("type") == "query"} == {3}
        assert_group_composition(f1, policy_n=3, ref_n=2)
        assert all(x["ref_correct"] >= 1 for x in kept_groups(f1))  # rule (b) applied
        assert_group_composition(q1, policy_n=4, ref_n=0)
        quatro = read_metrics(q1)[-1]
        assert quatro["reward/advantage_abs_mean"] > 0 and quatro["train/updates"] == 1

        report = json.loads((root / "report" / "report.json").read_text())
        assert set(report["variants"]) == {"filter_g1", "quatro"}
        assert {p["n"] for p in report["pairs"]} == {2}
        assert (root / "report" / "report.md").is_file()
        assert list((root / "report").glob("val_*.png"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
