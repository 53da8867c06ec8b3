"""e2e tier: ``armor pipeline configs/tiny_pipeline.yaml`` through both stages, killed anywhere.

A short variant of the tiny pipeline (overrides below): stage 1 DAPO with a detector forced to
fire at its second validation (``min_delta=1``: no validation counts as an improvement;
``patience=2``; any reward trend), so stage 1 ends at step 4 of at most 6 on the detector;
stage 2 ARMOR for 2 steps (a checkpoint each, the reset at step 2) from stage 1's exported
best checkpoint. One pipeline runs uninterrupted; a second loses its Ray raylet (``kill -9`` of
that process alone) inside stage 1 (after the step-2 checkpoint): Ray's core ends the driver,
and ``armor pipeline`` names the loss and exits 75; then it is killed with ``kill -9`` of its
whole process group between the stages (at the "stage 1 finished" line) and inside stage 2
(after its step-1 checkpoint); restarted each time with the same command, it must log exactly
the uninterrupted pipeline's metrics in both stages. No process of the run outlives any of
these (found by the run's Ray temp dir in their environment: Ray's, the actors', what they
started). Ray runs in its own session: the group kill reaches the driver, and every Ray process
of the run stops with it. Every kill waits on a file or a log line.
``armor convert --to-hf STAGE1 best`` reproduces the model stage 2 started from, and ``armor
eval`` of it gives the run's validation numbers of that step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_armor.observability.metrics import read_metrics, without_wall_clock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from process_group import (  # noqa: E402
    kill_leftovers,
    raylet_pids,
    wait_until,
    wait_until_gone,
    wait_until_no_run_process,
)

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420
RECONNECT = {"RAY_gcs_rpc_server_reconnect_timeout_s": "10"}
"""How long Ray's core waits for a lost GCS before it ends the process (60 s by default; the
local head's ``ray start --block`` takes the GCS down with the raylet): the run whose raylet
is killed waits 10 s of it."""


def short_pipeline(tiny: Path) -> list[str]:
    """Overrides of the CI variant (both stages unless prefixed)."""
    return [
        "algo.group_size=4", "rollout.batch=4", "rollout.gen_batch=8", "trainer.ppo_mini_batch=2",
        "validation.every=2", "validation.max_problems=8", "validation.n_samples=2",
        "logging.progress=false", "run.ckpt_every=2", "run.keep_last=1",
        f"trainer.model_path={tiny / 'model'}",
        f"data.train_files=[{tiny / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tiny / 'data' / 'val.parquet'}]",
        "stage1.run.steps=6", "stage1.overopt.patience=2", "stage1.overopt.min_delta=1.0",
        "stage1.overopt.min_reward_rise=-1e9",
        "stage2.run.steps=2", "stage2.run.ckpt_every=1", "stage2.algo.ref_n=2",
        "stage2.algo.reset.every=2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    path = Path(os.environ.get("ARMOR_TINY_DIR", REPO / "artifacts" / "tiny"))
    if not (path / "tiny.json").is_file():
        subprocess.run([sys.executable, "-m", "megatron_armor.cli", "tiny", "--out", str(path)],
                       check=True, timeout=900, cwd=REPO)  # fmt: skip
    return path


class PipelineProcess:
    """One ``armor pipeline`` process in its own process group and Ray temp dir."""

    def __init__(self, out: Path, name: str, tiny: Path, env: dict[str, str] | None = None):
        self.root = out / name
        self.ray_tmp = tempfile.mkdtemp(prefix="ap", dir="/tmp")  # short: unix socket paths
        self.log_path = out / f"{name}.{time.time_ns()}.log"
        env = dict(os.environ, RAY_TMPDIR=self.ray_tmp, RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   **(env or {}))  # fmt: skip
        cmd = [sys.executable, "-m", "megatron_armor.cli", "pipeline",
               str(REPO / "configs" / "tiny_pipeline.yaml"), f"output_dir={out}", f"name={name}",
               *short_pipeline(tiny)]  # fmt: skip
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def output(self) -> str:
        return self.log_path.read_text()[-6000:]

    def wait_for(self, predicate) -> None:
        wait_until(self.proc, predicate, TIMEOUT_S, self.output)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        finally:
            self.kill()

    def kill_group(self) -> None:
        """``kill -9`` of the process group alone, as a shell or a launcher does it: the Ray
        node (its own session, ``orchestration/actors/ray_node.py``) stops with the driver, and every
        Ray process of the run is gone (bounded); then the clean-up."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        wait_until_gone(self.ray_tmp, TIMEOUT_S, self.output)
        wait_until_no_run_process(self.ray_tmp, 60, self.output)
        self.kill()

    def lose_raylet(self) -> float:
        """``kill -9`` of the run's raylet alone: Ray's core ends the driver, and ``armor
        pipeline`` names the loss and exits 75; no process of the run left. Returns the
        seconds from the kill to the exit."""
        (raylet,) = raylet_pids(self.ray_tmp)
        os.kill(raylet, signal.SIGKILL)
        killed = time.monotonic()
        assert self.proc.wait(timeout=120) == 75, self.output()
        took = time.monotonic() - killed
        wait_until_no_run_process(self.ray_tmp, 60, self.output)
        self.kill()
        text = self.log_path.read_text()
        assert "armor pipeline: lost Ray's " in text and "--resume auto" in text, text[-3000:]
        return took

    def kill(self) -> None:
        """``kill -9`` of the process group and of Ray processes under its temp dir."""
        kill_leftovers(self.proc, self.ray_tmp)
        self.proc.wait(timeout=60)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def stable(run_dir: Path) -> list[dict]:
    return [without_wall_clock(r) for r in read_metrics(run_dir)]


def checkpoint_written(run_dir: Path, step: int):
    return lambda: (run_dir / "checkpoints" / f"step_{step:06d}" / "meta.json").is_file()


@pytest.fixture(scope="module")
def out_dir():
    path = Path(tempfile.mkdtemp(prefix="armor_pipeline_e2e_"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, out_dir) -> Path:
    run = PipelineProcess(out_dir, "whole", tiny_dir)
    assert run.finish() == 0, run.output()
    return run.root


def test_pipeline_runs_both_stages(uninterrupted):
    state = json.loads((uninterrupted / "pipeline.json").read_text())
    assert state["stage"] == "done" and state["stage1_end"] == "detector at step 4"
    stage1 = read_metrics(uninterrupted / "stage1")
    assert [r["step"] for r in stage1] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in stage1 if r.get("overopt/fired")] == [4]
    best = json.loads((uninterrupted / "stage1" / "checkpoints" / "best.json").read_text())
    assert state["best"]["step"] == best["step"] and best["metric"] == "val/*/avg@2"
    assert best["value"] == max(r["val/val/avg@2"] for r in stage1 if "val/val/avg@2" in r)
    stage2 = uninterrupted / "stage2"
    assert [r["step"] for r in read_metrics(stage2)] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(stage2) if r.get("reset/performed")] == [2]
    assert json.loads((stage2 / "source.json").read_text())["step"] == best["step"]
    assert (stage2 / "stage1").resolve() == (uninterrupted / "stage1").resolve()
    summary = json.loads((uninterrupted / "stage1" / "summary.json").read_text())
    assert summary["best_checkpoint"]["step"] == best["step"]
    assert summary["overoptimization_detected_at_step"] == 4


def test_convert_best_exports_the_stage2_start_model(uninterrupted, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "best_hf"
    subprocess.run([sys.executable, "-m", "megatron_armor.cli", "convert", "--to-hf",
                    str(uninterrupted / "stage1"), "best", "--out", str(out)],
                   check=True, timeout=300, cwd=REPO)  # fmt: skip
    exported = load_file(str(out / "model.safetensors"))
    started = load_file(str(uninterrupted / "stage1_best_hf" / "model.safetensors"))
    assert exported.keys() == started.keys()
    assert all(exported[k].equal(started[k]) for k in exported)
    # `armor eval` of the exported checkpoint with the run's config and the seed of the run's
    # validation at that step gives the run's own val/* numbers of that step
    stage1 = uninterrupted / "stage1"
    step = json.loads((stage1 / "checkpoints" / "best.json").read_text())["step"]
    subprocess.run([sys.executable, "-m", "megatron_armor.cli", "eval", "--config", str(stage1),
                    "--model", str(out), "--step", str(step), "--out", str(tmp_path / "eval"),
                    "--threads", "1"], check=True, timeout=300, cwd=REPO)  # fmt: skip
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    k = report["k"]
    logged = next(r for r in read_metrics(stage1) if r["step"] == step)
    for bench, values in report["results"].items():
        for metric in ("avg@k", "pass@k", "maj@k"):
            key = f"val/{bench}/{metric.replace('@k', f'@{k}')}"
            assert values[metric] == pytest.approx(logged[key], abs=1e-9), key


def test_kill9_in_each_stage_and_between_resumes_exactly(uninterrupted, tiny_dir, out_dir):
    name = "killed"
    root = out_dir / name
    first = PipelineProcess(out_dir, name, tiny_dir, env=RECONNECT)
    written = checkpoint_written(root / "stage1", 2)
    first.wait_for(lambda: written() and len(raylet_pids(first.ray_tmp)) == 1)
    print(f"raylet lost: armor pipeline exited 75 {first.lose_raylet():.1f}s after the kill")
    second = PipelineProcess(out_dir, name, tiny_dir)
    second.wait_for(lambda: "pipeline: stage 1 finished" in second.log_path.read_text())
    second.kill_group()
    assert json.loads((root / "pipeline.json").read_text())["stage"] in ("export", "stage2")
    third = PipelineProcess(out_dir, name, tiny_dir)
    third.wait_for(checkpoint_written(root / "stage2", 1))
    third.kill_group()
    last = PipelineProcess(out_dir, name, tiny_dir)
    assert last.finish() == 0, last.output()
    assert "resumed from" in last.log_path.read_text()
    for stage in ("stage1", "stage2"):
        assert stable(root / stage) == stable(uninterrupted / stage), stage
