"""Unit tier: the tiny warm start (batching, schedule, learning) and ``armor tiny``.

The learning test trains a very small model on level-1 problems for a few dozen steps; it
is the slowest unit test of the package (a few seconds on 2 cores).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from megatron_armor.cli import main
from megatron_armor.reward.dapo_rule import extract_answer
from megatron_armor.tiny.accuracy import measure_accuracy
from megatron_armor.tiny.build import TinyBuildConfig, build_tiny, read_marker
from megatron_armor.tiny.model import TinyModelConfig, build_model
from megatron_armor.tiny.task import Problem, generate_problems, render_solution
from megatron_armor.tiny.tokenizer import build_tokenizer, load_tokenizer
from megatron_armor.tiny.warmstart import (
    WarmStartConfig,
    check_due,
    collate,
    encode_example,
    lr_at,
    warm_start,
)

pytestmark = pytest.mark.unit

SMALL = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)
LEVEL1 = {1: 1.0}


def test_encode_example_masks_the_response_and_eos():
    tok = build_tokenizer()
    ids, mask = encode_example(tok, Problem("7-3", 4, 1))
    prompt_len = len("7-3=?")
    assert mask == [0] * prompt_len + [1] * (len(ids) - prompt_len)
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[prompt_len:-1]) == render_solution("7-3") == "7-3=4\nAnswer: 4"


def test_collate_pads_right_and_ignores_prompt_and_padding():
    ids, attn, labels = collate([([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert attn.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert labels.tolist() == [[-100, 6, 7], [-100, 9, -100]]


def test_lr_schedule_and_check_cadence():
    cfg = WarmStartConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    cfg = WarmStartConfig(check_every=25, first_check=100)
    assert [s for s in range(1, 160) if check_due(s, cfg)] == [100, 125, 150]
    with pytest.raises(ValueError, match="target_accuracy"):
        WarmStartConfig(target_accuracy=0.0)


@pytest.fixture(scope="module")
def trained():
    """A small model before/after a short level-1 warm start."""
    tok = build_tokenizer()
    model = build_model(SMALL)
    probe = generate_problems(64, 99, LEVEL1)
    before = measure_accuracy(model, tok, probe, temperature=0.0, max_new_tokens=20)
    cfg = WarmStartConfig(
        max_steps=150, batch_size=32, lr=2e-2, warmup_steps=5, check_every=0, log_every=0
    )
    result = warm_start(model, tok, cfg, levels=LEVEL1)
    after = measure_accuracy(model, tok, probe, temperature=0.0, max_new_tokens=20)
    return result, before, after


def test_short_warm_start_improves_accuracy(trained):
    result, before, after = trained
    assert result.steps == 150
    assert before.accuracy == 0.0
    assert after.accuracy >= before.accuracy + 0.3


def test_greedy_outputs_of_a_warm_started_model_parse(trained):
    _, _, after = trained
    parsed = [extract_answer(r) is not None for r in after.responses]
    assert sum(parsed) / len(parsed) >= 0.9


def test_warm_start_stops_at_target_accuracy():
    tok = build_tokenizer()
    model = build_model(SMALL)
    cfg = WarmStartConfig(
        max_steps=200, batch_size=32, lr=2e-2, warmup_steps=5, check_every=20,
        first_check=20, check_problems=32, target_accuracy=0.05, log_every=0,
    )  # fmt: skip
    result = warm_start(model, tok, cfg, levels=LEVEL1)
    assert result.history and result.history[-1][2] >= 0.05
    assert result.steps == result.history[-1][0] < 200


def tiny_build_config() -> TinyBuildConfig:
    return TinyBuildConfig(
        n_train=8,
        n_val=6,
        model=SMALL,
        warm_start=WarmStartConfig(max_steps=2, batch_size=8, check_every=0, log_every=0),
    )


def test_build_tiny_writes_a_complete_directory_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    record = build_tiny(tmp_path, tiny_build_config())
    assert not record["skipped"]
    assert (tmp_path / "data" / "train.parquet").is_file()
    assert (tmp_path / "data" / "val.parquet").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), local_files_only=True)
    assert model.config.hidden_size == SMALL.hidden_size
    assert load_tokenizer(tmp_path / "model").eos_token == "<|endoftext|>"
    assert read_marker(tmp_path)["warm_start"]["steps"] == 2
    assert set(record["accuracy"]) == {"train_sampled", "train_greedy", "val_sampled", "val_greedy"}
    again = build_tiny(tmp_path, tiny_build_config())
    assert again["skipped"]
    (tmp_path / "model" / "model.safetensors").unlink()
    rebuilt = build_tiny(tmp_path, tiny_build_config(), force=True)
    assert not rebuilt["skipped"]
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_armor_tiny_command(tmp_path, capsys):
    args = ["tiny", "--out", str(tmp_path), "--max-steps", "1", "--n-train", "4", "--n-val", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warm start: 1 steps" in out and "accuracy train_sampled" in out
    assert json.loads((tmp_path / "tiny.json").read_text())["config"]["n_train"] == 4
    assert main(args) == 0
    assert "already complete" in capsys.readouterr().out
