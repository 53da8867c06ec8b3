"""``DecodeStep``: the embedded engine's decode step without the HF module machinery gives
the HF forward's logits (Qwen2 and Llama, GQA or not, biases, padding or none, rows leaving),
the engine samples the same with it as without, and anything it does not mirror falls back
(unit tier: random 2-layer models in memory)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from megatron_armor.rollout.decode_step import DecodeStep, decode_step_for
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.torch_engine import BufferedKVLayer, TorchEngine, left_pad

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=128, eos_token_id=1, pad_token_id=0)  # fmt: skip


def qwen2(kv_heads: int = 2, **extra) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, num_attention_heads=4, num_key_value_heads=kv_heads, **extra)
    return Qwen2ForCausalLM(config).eval()


def llama(kv_heads: int = 2, bias: bool = True, **extra) -> LlamaForCausalLM:
    torch.manual_seed(1)
    config = LlamaConfig(**SHAPE, num_attention_heads=4, num_key_value_heads=kv_heads,
                         attention_bias=bias, mlp_bias=bias, **extra)  # fmt: skip
    return LlamaForCausalLM(config).eval()


MODELS = {
    "qwen2-gqa": lambda: qwen2(kv_heads=2),
    "qwen2-mha": lambda: qwen2(kv_heads=4),
    "llama-gqa-bias": lambda: llama(kv_heads=1, bias=True),
    "llama-mha": lambda: llama(kv_heads=4, bias=False),
    "llama3-rope": lambda: llama(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}  # fmt: skip


def new_cache(model, buffered: bool) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if buffered:
        cache.layers = [BufferedKVLayer(limit=64, block=4) for _ in cache.layers]
    return cache


def hf_logits(model, ids, mask, positions, cache) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                use_cache=True, logits_to_keep=1)  # fmt: skip
    return out.logits[:, -1, :]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("prompts", [[[5, 6, 7], [8, 9, 10, 11, 12], [20]], [[5, 6], [7, 8]]],
                         ids=["padded", "unpadded"])  # fmt: skip
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "dynamic"])
@torch.inference_mode()
def test_decode_step_logits_equal_the_hf_forward(name, prompts, buffered):
    """Prefill through HF into two caches; then 12 decode steps, the same tokens fed to the HF
    forward on one cache and to ``DecodeStep`` on the other; after step 5 the padded row
    leaves (the mask may lose its padding, as when finished rows leave the engine's batch)."""
    model = MODELS[name]()
    step = decode_step_for(model)
    assert isinstance(step, DecodeStep)
    ids, mask, positions = left_pad(prompts, 0, torch.device("cpu"))
    caches = [new_cache(model, buffered), new_cache(model, buffered)]
    logits = [hf_logits(model, ids, mask, positions, c) for c in caches]
    next_pos = positions[:, -1:] + 1
    gen = torch.Generator().manual_seed(3)
    for t in range(12):
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        token = torch.randint(2, SHAPE["vocab_size"], (ids.shape[0], 1), generator=gen)
        if t == 5 and ids.shape[0] > 2:  # the two shorter prompts' rows leave
            keep = torch.tensor([1])
            for c in caches:
                c.batch_select_indices(keep)
            token, mask, next_pos = token[keep], mask[keep], next_pos[keep]
            ids = ids[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        logits = [hf_logits(model, token, mask, next_pos, caches[0]),
                  step(token, mask, next_pos, caches[1])]  # fmt: skip
        next_pos = next_pos + 1
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_models_it_does_not_mirror_fall_back():
    assert decode_step_for(qwen2(attn_implementation="eager")) is None
    assert decode_step_for(llama(hidden_act="gelu")) is None
    sliding = qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert "sliding_attention" in sliding.config.layer_types
    assert decode_step_for(sliding) is None
    assert decode_step_for(qwen2().model) is None  # the decoder without its LM head
    hooked = qwen2()
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert decode_step_for(hooked) is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_qwen2):
    return tiny_qwen2(tmp_path_factory.mktemp("decode") / "m", seed=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=14, stop_token_ids=(2, 3, 4), seed=5),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=10, seed=1),
        SamplingParams(temperature=0.0, max_new_tokens=6),
    ],
)
def test_engine_samples_the_same_with_and_without_it(model_dir, params):
    """Both weight sets, chunks of 4 rows, rows leaving early, a weight update in between:
    the same tokens, log-probs within fp32 rounding."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20]]
    fast = TorchEngine(model_dir, max_batch=4)
    plain = TorchEngine(model_dir, max_batch=4, fast_decode=False)
    assert fast._decode_step("policy") is not None and plain._decode_step("policy") is None
    scaled = [(k, v * 1.5 if k.endswith("up_proj.weight") else v) for k, v in fast.state_tensors()]
    for engine in (fast, plain):
        engine.update_weights(scaled, version=1, weights="ref")
    for weights in ("policy", "ref"):
        a = fast.generate(prompts, 3, params, weights=weights)
        b = plain.generate(prompts, 3, params, weights=weights)
        for row_a, row_b in zip(a, b, strict=True):
            for x, y in zip(row_a, row_b, strict=True):
                assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5

    # the ref set reads its weights at every call: another update is seen by the next one
    def drawn(weights):
        return [
            [(s.token_ids, s.logprobs) for s in g]
            for g in fast.generate(prompts, 1, params, weights=weights)
        ]

    def same(a, b) -> bool:
        """Same tokens; log-probs within fp32 rounding: the two weight sets hold the same values
        in separate tensors, which some CPUs' matmul kernels round differently in the last
        digits (an AMD EPYC does; an Intel Xeon gave equal bits)."""
        return all(
            ta == tb and max((abs(p - q) for p, q in zip(la, lb, strict=True)), default=0) < 1e-5
            for ga, gb in zip(a, b, strict=True)
            for (ta, la), (tb, lb) in zip(ga, gb, strict=True)
        )

    before = drawn("ref")
    fast.update_weights(fast.state_tensors("policy"), version=2, weights="ref")
    now = drawn("ref")
    assert same(now, drawn("policy")) and now != before
