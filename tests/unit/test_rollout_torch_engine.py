"""Embedded ``torch`` engine: exact log-probs, seeds, stop tokens, weight sets, windowed
generation (a partial rollout interrupted by a weight push and continued under the new
weights) (unit tier: CPU only, a 2-layer Qwen2 built in a temp dir)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from megatron_armor.rollout.protocol import PartialRequest, SamplingParams
from megatron_armor.rollout.torch_engine import BufferedKVLayer, TorchEngine

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


EOS = 1
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_qwen2):
    root = tmp_path_factory.mktemp("tiny")
    return tiny_qwen2(root / "a", seed=0), tiny_qwen2(root / "b", seed=1)


@pytest.fixture
def engine(model_dirs):
    return TorchEngine(model_dirs[0], max_batch=4)


def other_weights(model_dirs) -> list[tuple[str, torch.Tensor]]:
    return list(TorchEngine(model_dirs[1]).state_tensors())


def max_logprob_error(engine, prompts, outputs, temperature, weights="policy") -> float:
    err = 0.0
    for prompt, samples in zip(prompts, outputs, strict=True):
        for s in samples:
            ref = engine.teacher_forced_logprobs(prompt, s.token_ids, temperature, weights)
            err = max(err, max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True)))
    return err


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, seed=1),
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=6),
    ],
)
def test_logprobs_equal_teacher_forced_forward(engine, params):
    out = engine.generate(PROMPTS, 3, params)
    assert [len(o) for o in out] == [3, 3, 3]
    assert max_logprob_error(engine, PROMPTS, out, params.temperature) < 1e-5
    for samples in out:
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            assert s.weight_version == 0


def test_same_seed_same_samples_and_seeds_differ(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)
    first = engine.generate(PROMPTS, 2, params)
    again = engine.generate(PROMPTS, 2, params)
    other = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=10, seed=8))
    ids = [[s.token_ids for s in g] for g in first]
    assert ids == [[s.token_ids for s in g] for g in again]
    assert ids != [[s.token_ids for s in g] for g in other]


def test_stop_tokens_end_samples(engine):
    stops = tuple(range(2, 20))
    out = engine.generate(
        PROMPTS, 4, SamplingParams(max_new_tokens=30, stop_token_ids=stops, seed=0)
    )
    reasons = set()
    for samples in out:
        for s in samples:
            ended = {EOS, *stops}
            assert not ended.intersection(s.token_ids[:-1])
            reasons.add(s.finish_reason)
            assert s.finish_reason == ("stop" if s.token_ids[-1] in ended else "length")
            assert s.finish_reason == "stop" or len(s.token_ids) == 30
    assert "stop" in reasons
    every = tuple(range(64))
    out = engine.generate(
        PROMPTS, 2, SamplingParams(max_new_tokens=5, stop_token_ids=every, seed=0)
    )
    assert all(len(s.token_ids) == 1 and s.finish_reason == "stop" for g in out for s in g)


def test_weight_update_changes_outputs_and_version(engine, model_dirs):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    before = engine.generate(PROMPTS, 2, params)
    engine.update_weights(other_weights(model_dirs), version=5)
    after = engine.generate(PROMPTS, 2, params)
    assert engine.weight_version() == 5
    assert all(s.weight_version == 5 for g in after for s in g)
    assert [s.logprobs for g in before for s in g] != [s.logprobs for g in after for s in g]
    fresh = TorchEngine(model_dirs[1])
    assert max_logprob_error(fresh, PROMPTS, after, 1.0) < 1e-5


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(KeyError, match="unknown tensor 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(64, 32))], 1)
    with pytest.raises(ValueError, match=r"shape \(3, 3\).*expects \(64, 32\)"):
        engine.update_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))], 1)
    assert engine.weight_version() == 0


def test_ref_weight_set_is_separate(engine, model_dirs):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=4)
    with pytest.raises(KeyError, match="weight set 'ref' is not loaded"):
        engine.generate(PROMPTS, 1, params, weights="ref")
    engine.update_weights(other_weights(model_dirs), version=2, weights="ref")
    assert (engine.weight_version("policy"), engine.weight_version("ref")) == (0, 2)
    ref_out = engine.generate(PROMPTS, 2, params, weights="ref")
    policy_out = engine.generate(PROMPTS, 2, params)
    fresh_ref = TorchEngine(model_dirs[1])
    assert max_logprob_error(fresh_ref, PROMPTS, ref_out, 1.0) < 1e-5
    assert max_logprob_error(engine, PROMPTS, policy_out, 1.0) < 1e-5
    assert all(s.weight_version == 2 for g in ref_out for s in g)


def test_chunking_matches_contract_and_memory_calls_are_safe_on_cpu(model_dirs):
    engine = TorchEngine(model_dirs[0], max_batch=1)
    out = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=4, seed=0))
    assert [len(o) for o in out] == [3, 3, 3]
    assert max_logprob_error(engine, PROMPTS, out, 1.0) < 1e-5
    engine.release_memory()  # no-op on CPU (documented)
    assert engine.health()
    engine.resume_memory()
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], 1, SamplingParams())


def test_buffered_kv_layer_holds_what_dynamic_layer_holds():
    """Same keys/values as transformers' concatenating layer through a prefill, decode steps
    that cross the growth blocks, a longer-than-block input, and row selections."""
    gen = torch.Generator().manual_seed(0)
    ours, theirs = BufferedKVLayer(limit=9, block=2), DynamicLayer()

    def step(rows: int, tokens: int) -> None:
        k, v = (torch.randn(rows, 2, tokens, 4, generator=gen) for _ in range(2))
        got, want = ours.update(k, v), theirs.update(k, v)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        assert ours.get_seq_length() == theirs.get_seq_length() == want[0].shape[-2]

    step(3, 4)  # prefill: room for 2 more
    assert ours._k.shape[-2] == 6
    step(3, 1)
    for layer in (ours, theirs):
        layer.batch_select_indices(torch.tensor([0, 0, 2, 1]))  # a prompt repeated, reordered
    step(4, 1)
    step(4, 1)  # 7 > 6: grows to the limit 9, not past it
    assert ours._k.shape[-2] == 9
    for layer in (ours, theirs):
        layer.batch_select_indices(torch.tensor([3, 1]))  # rows that stopped leave
    step(2, 5)  # longer than the limit: grows to fit
    assert ours._k.shape[-2] == 12
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    for layer in (ours, theirs):  # the rest of the layer API keeps the buffers in step
        layer.crop(-3)
        layer.batch_repeat_interleave(2)
    step(4, 1)
    for layer in (ours, theirs):
        layer.reset()
    step(2, 3)
    fresh = BufferedKVLayer(limit=4, block=1)
    fresh.reorder_cache(torch.tensor([0]))  # before any update: nothing to reorder
    with pytest.raises(ValueError, match="minus the number"):
        fresh.crop(2)


@pytest.mark.parametrize("kv_block", [1, 3])
def test_buffered_cache_samples_what_dynamic_cache_samples(model_dirs, kv_block):
    """Growth every 1 or 3 tokens, rows stopping early, chunks of 4 rows: the same tokens as
    transformers' ``DynamicCache`` (``kv_block=0``), log-probs within fp32 rounding. Attention
    reads the keys and values as a view of a larger buffer here and as a concatenated tensor
    there: the same arithmetic on data laid out differently, which a CPU's kernels may round
    differently in the last digits (bit-identical on the Intel Xeon and AMD EPYC measured)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=14, stop_token_ids=(2, 3, 4), seed=5)
    buffered = TorchEngine(model_dirs[0], max_batch=4, kv_block=kv_block)
    plain = TorchEngine(model_dirs[0], max_batch=4, kv_block=0)
    out = buffered.generate(PROMPTS, 3, params)
    for got, want in zip(out, plain.generate(PROMPTS, 3, params), strict=True):
        for a, b in zip(got, want, strict=True):
            assert (a.token_ids, a.finish_reason, a.weight_version) == (
                b.token_ids, b.finish_reason, b.weight_version
            )  # fmt: skip
            assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    lengths = {len(s.token_ids) for g in out for s in g}
    assert len(lengths) > 1 and max(lengths) == 14  # some rows left the batch early
    with pytest.raises(ValueError, match="kv_block=-1"):
        TorchEngine(model_dirs[0], kv_block=-1)


def test_moe_expert_weights_load_into_the_fused_experts(tmp_path):
    """A Qwen3-MoE engine takes the per-expert tensors the trainer exports (checkpoint names)
    into transformers' fused experts: after the update it computes the logits of the model
    the tensors came from; a wrong expert index is refused as an unknown name."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, mlp_only_layers=[1],
    )  # fmt: skip
    for seed, name in ((1, "a"), (2, "b")):
        torch.manual_seed(seed)
        Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / name)
    engine = TorchEngine(str(tmp_path / "a"))
    tensors = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert any(".mlp.experts.3.up_proj.weight" in k for k in tensors)
    engine.update_weights(tensors.items(), version=1)
    tokens = torch.tensor([[1, 5, 9, 2]])
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b")).eval()(tokens).logits
    with torch.no_grad():
        got = engine._model("policy")(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    bad = [("model.layers.0.mlp.experts.4.down_proj.weight", torch.zeros(32, 16))]
    with pytest.raises(KeyError, match="unknown tensor"):
        engine.update_weights(bad, version=2)


def test_moe_routes_are_the_teacher_forced_forward_routes(tmp_path, model_dirs):
    """``return_routed_experts``: each sample's routes cover prompt + response - 1 positions,
    hold zeros at the dense layer and equal the experts transformers' routers pick in one
    teacher-forced forward over prompt + response (rows leaving the batch early included); a
    dense model returns none, an engine not asked returns none."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, mlp_only_layers=[1],
    )  # fmt: skip
    torch.manual_seed(3)
    Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    engine = TorchEngine(str(tmp_path / "moe"), max_batch=3, return_routed_experts=True)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=6, seed=1, stop_token_ids=tuple(range(0, 64, 4))
    )
    prompts = [[5, 6, 7], [8, 9, 10, 12, 13]]
    outs = engine.generate(prompts, 2, params)
    model = engine._model("policy")
    gate = model.model.layers[0].mlp.gate
    for prompt, samples in zip(prompts, outs, strict=True):
        for s in samples:
            routes = s.routed_experts.array()
            assert routes.shape == (len(prompt) + len(s.token_ids) - 1, 2, 2)
            assert (routes[:, 1] == 0).all()  # the dense layer
            want = routes_of_forward(model, gate, prompt + s.token_ids[:-1])
            assert torch.equal(torch.from_numpy(routes[:, 0]).long().sort(-1).values, want)
    assert any(len(s.token_ids) < 6 for g in outs for s in g)  # a row stopped early
    plain = TorchEngine(str(tmp_path / "moe"), max_batch=3).generate(prompts, 1, params)
    assert plain[0][0].routed_experts is None
    dense = TorchEngine(model_dirs[0], return_routed_experts=True).generate(prompts, 1, params)
    assert dense[0][0].routed_experts is None


def routes_of_forward(model, gate, tokens: list[int]) -> torch.Tensor:
    """The sorted experts ``gate`` picks per position in one forward over ``tokens``."""
    seen = []
    hook = gate.register_forward_hook(lambda m, a, o: seen.append(o[2]))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    hook.remove()
    return seen[0].sort(-1).values


def test_a_window_as_long_as_the_response_is_plain_generation(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    plain = [g[0] for g in engine.generate(PROMPTS, 1, params)]
    window = engine.generate_window([PartialRequest(p) for p in PROMPTS], params, 12)
    assert [w.token_ids for w in window] == [p.token_ids for p in plain]
    assert [w.logprobs for w in window] == [p.logprobs for p in plain]
    reasons = [("stop" if p.finish_reason == "stop" else "length") for p in plain]
    assert [w.finish_reason for w in window] == reasons


def test_interrupted_by_a_push_and_continued_under_the_new_weights(engine, model_dirs):
    """Windows of 4 tokens: what a request has at the push is continued, never restarted,
    under the pushed weights; each token's log-prob is that of the weights that drew it
    (teacher-forced under those weights), and the windows stop at ``max_new_tokens``."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    first = engine.generate_window([PartialRequest(p) for p in PROMPTS], params, 4)
    going = [PartialRequest(p, o.token_ids) for p, o in zip(PROMPTS, first, strict=True)
             if o.finish_reason == "partial"]  # fmt: skip
    assert going, "every request stopped in its first window: pick another seed"
    assert all(len(r.response_ids) == 4 for r in going)
    engine.update_weights(other_weights(model_dirs), version=1)
    second = engine.generate_window(going, params, 4)
    last = [PartialRequest(r.prompt_ids, r.response_ids + o.token_ids)
            for r, o in zip(going, second, strict=True) if o.finish_reason == "partial"]  # fmt: skip
    third = engine.generate_window(last, params, 4)
    assert all(o.weight_version == 1 for o in second + third)
    assert all(o.finish_reason in ("stop", "length") and len(o.token_ids) <= 2 for o in third)
    old = TorchEngine(model_dirs[0])
    for request, out in zip(going, second, strict=True):
        prefix, prompt = request.response_ids, request.prompt_ids
        drawn = first[PROMPTS.index(prompt)].logprobs
        before = old.teacher_forced_logprobs(prompt, prefix, 1.0)
        after = engine.teacher_forced_logprobs(prompt, prefix + out.token_ids, 1.0)
        assert torch.allclose(torch.tensor(before), torch.tensor(drawn), atol=1e-5)
        assert torch.allclose(torch.tensor(after[len(prefix) :]), torch.tensor(out.logprobs),
                              atol=1e-5)  # fmt: skip


def test_each_output_says_when_its_last_token_came(engine):
    """``GenerationOutput.seconds``: from the call's start to the response's last token, so
    within a chunk a longer response ends no earlier than a shorter one."""
    stops = tuple(range(2, 30))
    started = time.perf_counter()
    out = [s for g in engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=20,
           stop_token_ids=stops, seed=0)) for s in g][:4]  # fmt: skip
    took = time.perf_counter() - started
    assert len({len(s.token_ids) for s in out}) > 1, "pick another seed: one length only"
    by_length = sorted(out, key=lambda s: len(s.token_ids))
    assert all(a.seconds <= b.seconds for a, b in itertools.pairwise(by_length))
    assert all(0 < s.seconds <= took for s in out)


def test_a_finished_request_is_refused(engine):
    params = SamplingParams(max_new_tokens=3, seed=0)
    with pytest.raises(ValueError, match="request 0 has 3 response tokens, max_new_tokens=3"):
        engine.generate_window([PartialRequest([5, 6], [7, 8, 9])], params, 2)
