"""Unit tier: the tiny character-level tokenizer and the tiny Qwen2 model directory."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from megatron_armor.data.dataset import load_prompt_dataset
from megatron_armor.tiny.model import TinyModelConfig, padded_vocab_size, write_model_dir
from megatron_armor.tiny.task import (
    TRAIN_LEVELS,
    generate_problems,
    render_prompt,
    render_solution,
    write_task,
)
from megatron_armor.tiny.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    build_tokenizer,
    build_vocab,
    load_tokenizer,
)

pytestmark = pytest.mark.unit

SMALL = TinyModelConfig(
    hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("tiny") / "model", SMALL)


def test_tokenizer_round_trip_is_one_token_per_char():
    tok = build_tokenizer()
    text = "57+8=65\n65-13=52\nAnswer: 52 {x} ~!"
    ids = tok(text).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_tokenizer_loads_from_model_dir(model_dir):
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok("12+7=?").input_ids == build_tokenizer()("12+7=?").input_ids
    assert len(tok) == len(build_vocab())
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "3+4=?"}], tokenize=False, add_generation_prompt=True
        )
        == "3+4=?"
    )


def test_load_tokenizer_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="armor tiny"):
        load_tokenizer(tmp_path)


def test_model_dir_is_a_qwen2_checkpoint(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["vocab_size"] == padded_vocab_size(len(build_vocab()), 64) == 128
    assert config["eos_token_id"] == build_vocab()[EOS_TOKEN]
    assert config["rope_theta"] == SMALL.rope_theta
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "generation_config.json").is_file()


def test_model_loads_offline_and_generates(model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    assert model.config.num_key_value_heads == SMALL.num_kv_heads
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 qkv bias
    tok = load_tokenizer(model_dir)
    ids = torch.tensor([tok("3+4=?").input_ids])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 1 and 5 < out.shape[1] <= 10


def test_model_config_checks():
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        TinyModelConfig(hidden_size=130, num_heads=4)


@pytest.mark.parametrize("template", ["plain", "dapo", "chat"])
def test_data_loader_prompts_match_the_warm_start_prompts(tmp_path, model_dir, template):
    """The RL prompts (data loader) are exactly the prompts the warm start trains on."""
    paths = write_task(tmp_path, n_train=20, n_val=4, seed=5)
    tok = load_tokenizer(model_dir)
    dataset = load_prompt_dataset([str(paths["train"])], tok, template, max_prompt_len=32)
    problems = generate_problems(20, 5, TRAIN_LEVELS)
    assert len(dataset) == 20
    for item, problem in zip(dataset, problems, strict=True):
        assert item.prompt_ids == tok(render_prompt(problem)).input_ids
        assert item.ground_truth == str(problem.answer)
        assert render_solution(problem.expression).endswith(f"Answer: {item.ground_truth}")


SMALL_MOE = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4,
    moe_intermediate_size=16,
)  # fmt: skip


def test_moe_variant_is_a_qwen3_moe_checkpoint(tmp_path):
    """``armor tiny --moe``'s model: a Qwen3-MoE directory as released ones are (``num_experts``
    beside transformers 5's ``num_local_experts``: SGLang's Qwen3-MoE reads the former;
    per-expert tensors on disk, the names the trainer exports and SGLang's ``load_weights``
    takes), every layer sparse, top-2 renormalised; the dense default stays Qwen2."""
    from safetensors import safe_open

    from megatron_armor.config.moe import moe_shape
    from megatron_armor.tiny.model import load_model

    model_dir = write_model_dir(tmp_path / "moe", SMALL_MOE)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["num_experts"] == config["num_local_experts"] == 4
    shape = moe_shape(config)
    assert (shape.topk, shape.expert_ffn, shape.norm_topk_prob) == (2, 16, True)
    assert shape.sparse_layers == (True, True)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    model = load_model(model_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.model.layers[0].self_attn.q_proj.bias is None  # Qwen3: no qkv bias
    assert "num_experts" not in json.loads((write_model_dir(tmp_path / "d", SMALL) /
                                           "config.json").read_text())  # fmt: skip
    with pytest.raises(ValueError, match="experts_per_token=5"):
        TinyModelConfig(num_experts=4, experts_per_token=5)


def test_tiny_command_builds_the_moe_variant_with_moe():
    import argparse

    from megatron_armor.cli import tiny_cmd

    parser = argparse.ArgumentParser()
    tiny_cmd.add_parser(parser.add_subparsers())
    moe = tiny_cmd.build_config(parser.parse_args(["tiny", "--moe", "--out", "x"]))
    dense = tiny_cmd.build_config(parser.parse_args(["tiny"]))
    assert moe.model.num_experts == tiny_cmd.MOE_EXPERTS and moe.model.experts_per_token == 2
    assert dense.model == TinyModelConfig() and dense.model.num_experts == 0
