"""e2e tier: rollout correction and the non-finite guard through the whole tiny ARMOR run.

- ``algo.rollout_correction.mode=token_tis``: every step logs the correction's weights and
  the engine/trainer mismatch per source, finite (fp32 CPU engines and trainer agree to
  ~1e-6, so the weights stay at 1 and nothing is truncated).
- A NaN in one update (a poisoned batch: the ``nan_advantages`` entry point gives one group
  of step 1 NaN advantages): that update is skipped, written and flagged as NaN, the step's
  other update is applied and pushed, and the run goes on finite to its end.
- A NaN in every update: after ``trainer.max_skipped_updates`` in a row the run stops with
  the named ``DivergedError`` and exit 65 (not the requeue code); no weight was pushed; the
  checkpoint it wrote holds the start weights exactly (``armor convert``) and a resume from it
  with sound settings trains on.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics
from megatron_armor.orchestration.step.step_metrics import read_anchor_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_runs import REPO, Run  # noqa: E402

pytestmark = pytest.mark.e2e

QUIET = ("validation.every=0", "run.ckpt_every=0")
POISONED = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")])}  # fmt: skip


def policy_versions(run_dir: Path, step: int) -> set[int]:
    kept = [x for x in read_anchor_file(run_dir, step) if x.get("kept")]
    return {v for x in kept for v in x["policy_versions"]}


@pytest.mark.timeout(900)
def test_token_tis_logs_finite_correction_and_mismatch_metrics(tiny_dir, out_dir):
    run = Run(out_dir, "token_tis", tiny_dir, "algo.rollout_correction.mode=token_tis",
              "run.steps=2", *QUIET)  # fmt: skip
    assert run.wait() == 0, run.output()
    records = [r for r in read_metrics(run.run_dir) if r["step"] >= 1]
    assert len(records) == 2
    for r in records:
        for source in ("policy", "anchor"):
            for key in (f"correction/{source}_weight_mean", f"correction/{source}_weight_max",
                        f"correction/{source}_cut_frac", f"rollout/{source}_mismatch_k1",
                        f"rollout/{source}_mismatch_k3"):  # fmt: skip
                assert math.isfinite(r[key]), (r["step"], key)
            assert r[f"correction/{source}_weight_mean"] == pytest.approx(1.0, abs=1e-3)
            assert r[f"correction/{source}_cut_frac"] == 0.0
            assert r[f"rollout/{source}_mismatch_k3"] < 1e-6
        assert r["train/skipped_updates"] == 0.0 and math.isfinite(r["loss/pg"])


@pytest.mark.timeout(900)
def test_a_nan_in_one_update_is_skipped_and_the_run_goes_on(tiny_dir, out_dir):
    run = Run(out_dir, "nan_once", tiny_dir, "algo.advantage=nan_grpo",
              "algo.advantage_args.steps=1", "algo.advantage_args.rows=1", "run.steps=3", *QUIET,
              env=POISONED, module="nan_advantages")  # fmt: skip
    assert run.wait() == 0, run.output()
    records = {r["step"]: r for r in read_metrics(run.run_dir)}
    first = records[1]
    assert first["train/skipped_updates"] == 1.0 and first["train/updates"] == 2.0
    assert math.isnan(first["loss/pg"]) and math.isnan(first["loss/grad_norm"])
    assert '"loss/pg": NaN' in (run.run_dir / "metrics.jsonl").read_text()
    assert "SKIPPED 1/2 updates" in run.text() and "NON-FINITE" in run.text()
    for step in (2, 3):
        r = records[step]
        assert r["train/skipped_updates"] == 0.0 and r["train/skipped_in_a_row"] == 0.0
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, float)), step
    assert policy_versions(run.run_dir, 2) == {1}  # step 1's applied update was pushed


@pytest.mark.timeout(900)
def test_a_nan_in_every_update_stops_the_run_with_a_named_error(tiny_dir, out_dir, tmp_path):
    run = Run(out_dir, "nan_always", tiny_dir, "algo.advantage=nan_grpo",
              "trainer.max_skipped_updates=3", "run.steps=4", *QUIET, env=POISONED,
              module="nan_advantages")  # fmt: skip
    code = run.wait()
    log = run.output()
    assert code == 65, log
    assert "DivergedError: training diverged: 3 optimizer updates in a row" in log
    assert "trainer.max_skipped_updates" in log and "at step 2" in log
    assert "loss/objective=nan" in log and "trainer.lr=0.0001" in log
    records = {r["step"]: r for r in read_metrics(run.run_dir)}
    assert sorted(records) == [1, 2]
    assert [records[s]["train/skipped_in_a_row"] for s in (1, 2)] == [2.0, 4.0]
    assert policy_versions(run.run_dir, 2) == {0}  # nothing pushed, no version bump
    ckpts = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000002"]
    # the checkpoint holds the start weights exactly: no update was ever applied
    hf = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "megatron_armor.cli", "convert", "--to-hf",
                    str(run.run_dir / "checkpoints" / "step_000002"), "--model",
                    str(tiny_dir / "model"), "--out", str(hf)],
                   check=True, cwd=REPO, timeout=300,
                   env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # fmt: skip
    from safetensors.torch import load_file

    start, saved = (
        load_file(tiny_dir / "model" / "model.safetensors"),
        load_file(hf / "model.safetensors"),
    )
    assert sorted(saved) == sorted(start)
    assert all(saved[k].float().equal(start[k].float()) for k in start)
    # and a resume from it with a sound estimator trains on
    resumed = Run(out_dir, "nan_always", tiny_dir, "run.steps=3", *QUIET)
    assert resumed.wait() == 0, resumed.output()
    assert "resumed from" in resumed.text() and "step_000002" in resumed.text()
    last = read_metrics(resumed.run_dir)[-1]
    assert last["step"] == 3 and last["train/skipped_updates"] == 0.0
    assert math.isfinite(last["loss/pg"]) and math.isfinite(last["loss/grad_norm"])
