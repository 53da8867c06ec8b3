"""``armor convert`` keeps the model the run trained: the exported ``config.json`` holds
``trainer.model_overrides`` (a RoPE base other than the model's own), and transformers, loading
the exported directory with nothing else, gives the Megatron trainer's logits. Tier: unit."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from megatron_armor.config.schema import TrainerConfig

pytestmark = pytest.mark.unit

OVERRIDES = {"rope_theta": 40000, "max_position_embeddings": 256}
LOGITS_TOL = 1e-4  # fp32 Megatron vs HF transformers (tests/dist/test_trainer_dist.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keep_logits(mb, output):
    return output.new_zeros(()), torch.tensor(0, dtype=torch.int), {"logits": output}


def _micro_batch(tokens: torch.Tensor):
    from megatron_armor.trainer.batching import build_micro_batch
    from megatron_armor.types import TrainBatch

    n, seq = tokens.shape
    zeros = torch.zeros(n * seq)
    batch = TrainBatch(
        tokens=tokens.reshape(-1), position_ids=torch.arange(seq).repeat(n),
        cu_seqlens=torch.arange(0, n * seq + 1, seq, dtype=torch.int32),
        sample_index=torch.arange(n).repeat_interleave(seq),
        token_data={"loss_mask": zeros, "is_anchor": zeros.bool()},
    )  # fmt: skip
    return build_micro_batch(batch, list(range(n)))


def trainer_logits_and_checkpoint(model_dir: str, tokens: torch.Tensor, ckpt: str) -> torch.Tensor:
    """The Megatron trainer's model under :data:`OVERRIDES` (one rank, gloo): its logits on
    ``tokens``, and its weights saved as a trainer checkpoint (``ckpt/dist``)."""
    from megatron.core import dist_checkpointing

    from megatron_armor.trainer import hf_weights, parallel
    from megatron_armor.trainer.model import build_model, read_hf_spec
    from megatron_armor.trainer.schedule import run_schedule

    parallel.init_parallel(parallel.ParallelLayout(), 0, 1, master_port=_free_port())
    try:
        spec = read_hf_spec(model_dir, OVERRIDES)
        model = build_model(spec, TrainerConfig(precision="fp32"))
        hf_weights.load_hf_weights(model, model_dir, spec)
        with torch.no_grad():
            out = run_schedule(model, [_micro_batch(tokens)], _keep_logits, forward_only=True)
        Path(ckpt, "dist").mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict()}, f"{ckpt}/dist")
    finally:
        parallel.destroy_parallel()
    return out[0]["logits"][..., : spec.vocab_size]


def hf_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def sharp_tiny_qwen2(path: Path) -> str:
    """A 2-layer Qwen2 (RoPE base 10000, 128 positions) with weights large enough that
    attention, hence the logits, depend on the positions' RoPE angles."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3, tie_word_embeddings=True,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_the_exported_model_gives_the_trainers_logits_under_the_rope_override(tmp_path):
    from megatron_armor.trainer.convert import convert_to_hf

    model_dir = sharp_tiny_qwen2(tmp_path / "model")
    tokens = torch.randint(0, 64, (2, 100), generator=torch.Generator().manual_seed(7))
    trained = trainer_logits_and_checkpoint(model_dir, tokens, str(tmp_path / "ckpt"))
    out = str(tmp_path / "exported")
    convert_to_hf(str(tmp_path / "ckpt"), model_dir, out, precision="fp32", overrides=OVERRIDES)
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == written["rope_theta"] == 40000.0
    assert written["max_position_embeddings"] == 256
    torch.testing.assert_close(hf_logits(out, tokens), trained, atol=LOGITS_TOL, rtol=0)
    # the override matters at these positions: the model's own RoPE gives other logits
    assert (hf_logits(model_dir, tokens) - trained).abs().max() > 100 * LOGITS_TOL
