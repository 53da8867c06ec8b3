"""The embedded engine on the ``device`` fixture's device (gpu tier with CUDA: SDPA's GPU
kernels; unit tier on CPU, the GPU memory counts left out)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.torch_engine import TorchEngine

pytestmark = [pytest.mark.gpu, pytest.mark.unit]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, device):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("gpu") / "m"
    Qwen2ForCausalLM(config).save_pretrained(path)
    return TorchEngine(str(path), device=device.type, max_batch=4)


def test_logprobs_match_teacher_forcing(engine):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16, seed=0)
    out = engine.generate(PROMPTS, 3, params)
    for prompt, group in zip(PROMPTS, out, strict=True):
        for s in group:
            ref = engine.teacher_forced_logprobs(prompt, s.token_ids, 0.7)
            assert max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)) < 1e-4
    assert out == engine.generate(PROMPTS, 3, params)  # same seed, same samples


def test_decode_step_samples_what_the_hf_forward_samples(engine, device):
    """``DecodeStep`` (on CUDA SDPA's GPU kernels, with and without a padding mask): the same
    tokens as decode steps through the HF forward, log-probs within 1e-4."""
    plain = TorchEngine(engine.model_dir, device=device.type, max_batch=4, fast_decode=False)
    assert engine._decode_step("policy") is not None
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=(2, 3), seed=4)
    for prompts in (PROMPTS, [[5, 6, 7], [8, 9, 10]]):
        fast, slow = engine.generate(prompts, 3, params), plain.generate(prompts, 3, params)
        for row_a, row_b in zip(fast, slow, strict=True):
            for a, b in zip(row_a, row_b, strict=True):
                assert a.token_ids == b.token_ids
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_release_frees_memory_and_resume_serves_again(engine, cuda_only):
    """On a GPU a release moves every weight set off the GPU (the engine refuses to generate
    until it resumes); on CPU both are no-ops and the engine keeps serving."""
    engine.update_weights(engine.state_tensors(), version=1, weights="ref")
    on_gpu = cuda_only("a release frees GPU memory; on CPU it is a no-op")
    used = torch.cuda.memory_allocated() if on_gpu else 0
    engine.release_memory()
    assert engine.health() is not on_gpu
    if on_gpu:
        assert torch.cuda.memory_allocated() < used
        with pytest.raises(RuntimeError, match="resume_memory"):
            engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))
    engine.resume_memory()
    assert engine.health()
    out = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2), weights="ref")
    assert all(s.weight_version == 1 for g in out for s in g)
