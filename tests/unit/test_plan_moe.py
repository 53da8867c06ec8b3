"""Planner (unit tier) on mixture-of-experts models: parameter counts, the experts' share of
the trainer state under expert parallelism, activations by active experts, FLOPs by active
parameters, the expert layout rules and the Qwen3-30B-A3B example config, all against hand
computations."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_armor.config import load_config
from megatron_armor.planner.flops import forward_flops, matmul_params
from megatron_armor.planner.memory import (
    TrainerShape,
    activation_bytes,
    moe_dispatch_bytes,
    route_host_bytes,
    state_terms,
)
from megatron_armor.planner.model import PRESETS, dims_from_hf_config
from megatron_armor.planner.plan import make_plan

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).parents[2] / "configs" / "moe" / "qwen3_30b_a3b_4x8_h100.yaml"

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
    "hidden_act": "silu",
}  # fmt: skip
"""The fields of Qwen/Qwen3-30B-A3B's config.json that the planner reads."""

# h 8, 2 heads of 4, 1 KV head, layer 0 dense (f 16), layer 1 sparse (4 experts of 4, top-2)
TINY = {
    "model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "intermediate_size": 16, "moe_intermediate_size": 4, "num_local_experts": 4,
    "num_experts_per_tok": 2, "mlp_only_layers": [0], "vocab_size": 10,
}  # fmt: skip
TINY_ATTENTION = 8 * (8 + 2 * 4) + 8 * 8  # h (q + 2 kv) + q h = 192
TINY_EXPERT = 3 * 8 * 4  # 96
TINY_EXPERTS = 4 * TINY_EXPERT  # the one sparse layer's experts: 384
TINY_TOTAL = (
    2 * (TINY_ATTENTION + 2 * 8)  # attention and two norms per layer
    + 3 * 8 * 16  # the dense layer's MLP
    + 4 * 8 + TINY_EXPERTS  # the sparse layer's router and experts
    + 10 * 8 + 10 * 8 + 8  # embedding, LM head, final norm
)  # fmt: skip


def test_tiny_moe_counts_by_hand():
    dims = dims_from_hf_config(TINY)
    assert (dims.num_experts, dims.topk, dims.expert_ffn, dims.moe_layers) == (4, 2, 4, 1)
    assert dims.total_params() == TINY_TOTAL == 1384
    assert dims.decoder_expert_params() == TINY_EXPERTS
    assert dims.active_params() == TINY_TOTAL - (4 - 2) * TINY_EXPERT == 1192


def test_qwen3_30b_a3b_preset_is_its_config_json_and_its_published_sizes():
    preset = PRESETS["qwen3-30b-a3b"]
    assert dims_from_hf_config(QWEN3_30B_A3B, name=preset.name) == preset
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048
    layer = attention + 2 * 2048 + 128 * 2048 + 128 * 3 * 2048 * 768
    embeddings = 2 * 151936 * 2048 + 2048  # untied embedding and LM head, final norm
    assert preset.total_params() == 48 * layer + embeddings == 30_532_110_336
    active = layer - (128 - 8) * 3 * 2048 * 768
    assert preset.active_params() == 48 * active + embeddings == 3_353_020_416
    assert preset.total_params() == pytest.approx(30.5e9, rel=0.01)  # "30.5B total"
    assert preset.active_params() == pytest.approx(3.3e9, rel=0.02)  # "3.3B activated"


def test_flops_count_the_active_experts_only():
    """MFU's numerator: a sparse layer's router and k of its E experts per token."""
    tiny = dims_from_hf_config(TINY)
    assert matmul_params(tiny) == 2 * TINY_ATTENTION + 3 * 8 * 16 + 4 * 8 + 2 * TINY_EXPERT + 80
    s = 5
    attention_scores = 2 * 2 * 2 * 4 * s * (s + 1)  # 2 L n_h d s (s + 1)
    assert forward_flops(tiny, s) == 2 * s * matmul_params(tiny) + attention_scores
    big = PRESETS["qwen3-30b-a3b"]
    per_layer = 2048 * (4096 + 1024) + 4096 * 2048 + 128 * 2048 + 8 * 3 * 2048 * 768
    assert matmul_params(big) == 48 * per_layer + 151936 * 2048
    assert matmul_params(big) < big.active_params() < big.total_params() / 9


def test_mfu_of_a_moe_run_is_measured_by_its_active_experts(tmp_path):
    """The run's meter reads the model's config.json: a Qwen3-MoE's MFU counts the router
    and k of the E experts per token (``matmul_params``, checked by hand above)."""
    import json

    from megatron_armor.observability.throughput import ThroughputMeter
    from megatron_armor.planner.model import load_model_dims

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    dims = load_model_dims(str(tmp_path))
    meter = ThroughputMeter(dims=dims, num_gpus=1, peak_tflops_per_gpu=1e-9)
    meter.add_train(seq_lens=[5, 5], seconds=1.0)
    mfu = meter.pop_metrics()["perf/mfu"]
    per_token = 2 * matmul_params(dims)  # forward, then x3 for forward + backward
    attention = 2 * 2 * 2 * 4 * 5 * 6
    assert mfu == pytest.approx(3 * 2 * (5 * per_token + attention) / 1e3)


@pytest.mark.parametrize(
    "ep, etp, dp, expert_dp",
    [(1, 1, 4, 4), (2, 1, 4, 2), (2, 2, 4, 1), (4, 1, 4, 1)],
)
def test_experts_and_their_optimizer_state_shard_by_ep_and_etp(ep, etp, dp, expert_dp):
    dims = dims_from_hf_config(TINY)
    shape = TrainerShape(dims, dp=dp, ep=ep, etp=etp, distributed_optimizer=True)
    assert shape.expert_dp == expert_dp
    experts, dense = TINY_EXPERTS / (ep * etp), TINY_TOTAL - TINY_EXPERTS
    terms = state_terms(shape, stage=0)
    assert terms["weights"] == pytest.approx((dense + experts) * 2)
    assert terms["grads"] == pytest.approx((dense + experts) * 4)
    assert terms["optimizer"] == pytest.approx(dense * 12 / dp + experts * 12 / expert_dp)


def test_sparse_layer_activations_follow_the_active_experts():
    """No recompute, one micro-batch of 100 tokens, bf16: the dense layer keeps 4h + (2q +
    2kv) + 3f elements per token, the sparse one 4h + (2q + 2kv), its fp32 router scores (2E
    bf16 elements), k routed copies' inputs and outputs (2 k h, gathered over etp) and their
    fc1 and activation outputs (3 k f_e)."""
    dims = dims_from_hf_config(TINY)
    attention = 4 * 8 + (8 + 2 * 4 + 8)
    dense_layer = attention + 3 * 16
    for etp in (1, 2):
        sparse_layer = attention + 2 * 4 + 2 * etp * 2 * 8 + 3 * 2 * 4
        shape = TrainerShape(dims, micro_batch_tokens=100, ep=2, etp=etp)
        assert activation_bytes(shape, 0) == pytest.approx(100 * (dense_layer + sparse_layer) * 2)
        assert moe_dispatch_bytes(shape) == (1 + etp) * 2 * 100 * 8 * 2
    assert moe_dispatch_bytes(TrainerShape(PRESETS["qwen3-8b"])) == 0.0


def test_the_example_config_fits_4x8_h100_with_the_experts_over_ep8():
    config = load_config(EXAMPLE)
    t = config.trainer
    assert (config.resolved.world_size, t.tp, t.ep, t.sequence_parallel) == (32, 2, 8, True)
    plan = make_plan(config, model="qwen3-30b-a3b", gpu_mem_gib=80)
    assert plan.fits, plan.report()
    m = plan.model  # the vocabulary padded to a multiple of 128 * tp
    dense, experts = (
        (m.total_params() - m.decoder_expert_params()) / 2,
        m.decoder_expert_params() / 8,
    )
    train = plan.phases["train"]
    assert train["weights"] == pytest.approx((dense + experts) * 2)
    assert train["optimizer"] == pytest.approx(dense * 12 / 16 + experts * 12 / 4)
    assert train["moe_dispatch"] == pytest.approx(2 * 8 * (16384 / 2) * 2048 * 2)
    assert plan.phases["rollout"]["weights"] == train["weights"]  # offload_train_state
    report = plan.report()
    assert "3.35 B active" in report and "16 of 128 per EP rank" in report


def test_the_plan_notes_routing_replay_s_host_memory_by_hand():
    """r3 at the example's longest step: 512 x 16 samples of 2,048 + 8,192 tokens, 384 bytes
    of routes per token (48 layers, top-8, uint8) in the batch; a rank's own samples (dp 16)
    and one of the 16 updates' share of them; ``off`` says nothing."""
    config = load_config(EXAMPLE)
    assert config.trainer.moe.routing_replay == "r3"
    tokens = 512 * 16 * (2048 + 8192)
    dims = make_plan(config, model="qwen3-30b-a3b").model
    sizes = route_host_bytes(dims, tokens, 16, 1, 16, True)
    assert sizes == {"batch": tokens * 384, "old": tokens / 16 * 384, "update": tokens / 256 * 384}
    report = make_plan(config, model="qwen3-30b-a3b").report()
    assert "routing replay r3" in report and "30.0 GiB per node" in report
    assert "1.88 GiB per rank" in report and "at most 120 MiB" in report
    off = load_config(EXAMPLE, ["trainer.moe.routing_replay=off"])
    assert "routing replay" not in make_plan(off, model="qwen3-30b-a3b").report()


def test_plan_json_gives_total_and_active_parameters(capsys):
    import json

    from megatron_armor.cli import main as armor_main

    assert armor_main(["plan", str(EXAMPLE), "--model", "qwen3-30b-a3b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    padded = 152064 - 151936  # vocabulary padded to 128 * tp: rows of the embedding and LM head
    assert out["parameters"] == 30_532_110_336 + 2 * padded * 2048
    assert out["active_parameters"] == 3_353_020_416 + 2 * padded * 2048
    assert out["phases_gib"]["train"]["moe_dispatch"] > 0 and out["fits"]


@pytest.mark.parametrize(
    "overrides, setting, words",
    [
        (["orchestration.nodes=3", "trainer.ep=3"], "trainer.ep", "must divide num_experts=128"),
        (["trainer.ep=1", "trainer.sequence_parallel=false"], "trainer.tp", "sequence_parallel"),
    ],
)
def test_the_plan_names_expert_layouts_the_model_rules_out(overrides, setting, words):
    """Rules that need the model's experts (load checks the rest, with the same messages):
    run on ``--model``, which ``trainer.model_path`` need not have."""
    plan = make_plan(load_config(EXAMPLE, overrides), model="qwen3-30b-a3b")
    errors = [f for f in plan.findings if f.level == "error" and f.setting == setting]
    assert errors and words in errors[0].message, plan.report()
    assert not plan.fits


def test_expert_parallelism_on_a_dense_model_is_an_error_of_the_plan():
    plan = make_plan(load_config(EXAMPLE), model="qwen3-8b")
    errors = [str(f) for f in plan.findings if f.level == "error"]
    assert any("trainer.ep" in e and "dense model" in e for e in errors)
