"""Keep-best checkpoints: outside the ``keep_last`` rotation, named ``best``, restored with the
run state; the pipeline's override routing. Tier: unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_armor.config.pipeline import PipelineConfig, split_overrides, stage_overrides
from megatron_armor.config.schema import ArmorConfig, KeepBestConfig
from megatron_armor.orchestration.run import checkpoints
from megatron_armor.orchestration.run.run_watch import RunWatch

pytestmark = pytest.mark.unit


def save(run_dir, watch: RunWatch, step: int, keep_last: int = 1) -> None:
    """What ``Session.save`` does around the trainer: state, best record, commit + rotation."""
    tmp = checkpoints.begin_checkpoint(run_dir, step)
    (tmp / "watch.json").write_text(json.dumps(watch.state_dict()))
    watch.publish(run_dir)
    checkpoints.commit_checkpoint(run_dir, tmp, step, keep_last)


def kept(run_dir) -> list[int]:
    return [step for step, _ in checkpoints.list_checkpoints(run_dir)]


def watched_config() -> ArmorConfig:
    config = ArmorConfig()
    config.run.keep_best = KeepBestConfig(metric="val/*/avg@4", mode="max")
    return config


def test_best_survives_rotation_until_a_better_one(tmp_path):
    watch = RunWatch(watched_config())
    vals = {2: 0.30, 4: 0.50, 6: 0.40, 8: 0.45, 10: 0.55}
    for step in range(1, 11):
        metrics = {"val/a/avg@4": vals[step]} if step in vals else {}
        watch.observe(step, metrics)
        if step % 2 == 0:
            save(tmp_path, watch, step)
        if step == 8:  # step 4 is the best: kept although keep_last is 1
            assert kept(tmp_path) == [4, 8]
            assert checkpoints.named_checkpoint(tmp_path, "best").name == "step_000004"
    assert kept(tmp_path) == [10]  # the new best replaced it; the old one rotated out
    assert checkpoints.read_best(tmp_path) == {
        "step": 10, "metric": "val/*/avg@4", "value": 0.55, "mode": "max",
    }  # fmt: skip


def test_best_is_restored_with_the_run_state(tmp_path):
    watch = RunWatch(watched_config())
    watch.observe(2, {"val/a/avg@4": 0.5})
    save(tmp_path, watch, 2)
    state = json.loads(
        (checkpoints.named_checkpoint(tmp_path, "latest") / "watch.json").read_text()
    )
    checkpoints.write_best(tmp_path, None)  # e.g. lost: the resume writes it again
    resumed = RunWatch(watched_config())
    resumed.load_state_dict(state)
    resumed.publish(tmp_path)
    assert checkpoints.read_best(tmp_path)["step"] == 2
    resumed.observe(4, {"val/a/avg@4": 0.4})
    assert not resumed.wants_checkpoint  # 0.4 < 0.5 is no new best after the resume


def test_named_checkpoints_and_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="run.keep_best.metric"):
        checkpoints.named_checkpoint(tmp_path, "best")
    watch = RunWatch(watched_config())
    watch.observe(3, {"val/a/avg@4": 0.1})
    save(tmp_path, watch, 3, keep_last=2)
    assert checkpoints.named_checkpoint(tmp_path, "3").name == "step_000003"
    assert checkpoints.named_checkpoint(tmp_path, "latest").name == "step_000003"
    with pytest.raises(ValueError, match="best, latest or a step"):
        checkpoints.named_checkpoint(tmp_path, "newest")


def test_pipeline_override_routing():
    own, stages = split_overrides(["name=p", "stage1.run.steps=6", "stage2.algo.alpha=0.9",
                                   "rollout.batch=4", "stage2.config=kl.yaml"])  # fmt: skip
    assert own == ["name=p", "stage2.config=kl.yaml"]
    assert stages == {"stage1": ["run.steps=6", "rollout.batch=4"],
                      "stage2": ["algo.alpha=0.9", "rollout.batch=4"]}  # fmt: skip
    config = PipelineConfig(name="p", output_dir="out")
    assert stage_overrides(config, "stage2") == [
        "run.output_dir=out/p", "run.name=stage2", "trainer.model_path=out/p/stage1_best_hf",
    ]  # fmt: skip


def test_pipeline_stage1_needs_the_detector(tmp_path):
    from megatron_armor.config import ConfigError
    from megatron_armor.config.pipeline import load_pipeline

    repo_configs = Path(__file__).resolve().parents[2] / "configs"
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"name: p\noutput_dir: {tmp_path}\nstage1: {{config: {repo_configs / 'tiny_cpu.yaml'}}}\n"
        f"stage2: {{config: {repo_configs / 'tiny_cpu.yaml'}}}\n"
    )
    with pytest.raises(ConfigError, match="overopt.enabled=true"):
        load_pipeline(pipeline)
    loaded = load_pipeline(pipeline, ["stage1.overopt.enabled=true", "name=q"])
    assert loaded.stage1.run.keep_best.metric == "val/*/avg@k"  # the detector's metric
    assert loaded.stage2.trainer.model_path == str(tmp_path / "q" / "stage1_best_hf")
    assert loaded.stage1.run.output_dir == str(tmp_path / "q")
