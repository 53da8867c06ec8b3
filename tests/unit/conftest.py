"""Fixtures shared by the rollout tests: one torch thread, and a tiny random Qwen2 HF dir."""

from __future__ import annotations

import pytest
import torch

TINY_EOS = 1


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one intra-op thread is fastest, and on a shared CI box extra threads
    only contend. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_tiny_qwen2(path, seed: int = 0) -> str:
    """A 2-layer Qwen2 (vocab 64, GQA, tied embeddings) saved as an HF dir at ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=TINY_EOS, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """``tiny_qwen2(path, seed) -> model_dir``: builds :func:`build_tiny_qwen2`."""
    return build_tiny_qwen2
