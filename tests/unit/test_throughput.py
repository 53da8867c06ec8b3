"""MFU / FLOPs formulas against hand-counted FLOPs (unit tier)."""

from __future__ import annotations

import pytest

from megatron_armor.observability.throughput import (
    ThroughputMeter,
    compute_precision,
    gpu_memory_metrics,
    mfu,
    peak_tflops,
)
from megatron_armor.planner.flops import forward_flops, matmul_params, training_flops
from megatron_armor.planner.model import PRESETS, ModelDims

pytestmark = pytest.mark.unit

# h=8, 2 layers, 2 query heads of d=4, 1 kv head (GQA), SwiGLU f=16, V=10.
TOY = ModelDims("toy", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn_hidden=16, vocab=10)


def test_toy_forward_flops_by_hand():
    # per layer: Q 8x8=64, K 8x4=32, V 32, O 8x8=64, MLP 3*8*16=384 -> 576; x2 layers + head 80
    assert matmul_params(TOY) == 2 * 576 + 80
    s = 3
    dense = 2 * s * 1232
    # causal attention: token i sees i+1 keys; QK^T and AV are 2*d FLOPs per head per key each
    attention = sum(2 * (2 * 4 * (i + 1)) * 2 for i in range(s)) * 2  # x heads, x layers
    assert forward_flops(TOY, s) == dense + attention
    assert training_flops(TOY, [3, 3]) == 3 * 2 * (dense + attention)


def test_8b_training_flops_close_to_6n_plus_attention():
    dims = PRESETS["llama-3-8b"]
    n = dims.total_params() - dims.embedding_params()  # matmul weights ~ non-embedding params
    s = 4096
    per_token = training_flops(dims, [s]) / s
    assert per_token == pytest.approx(6 * n + 6 * dims.layers * 4096 * (s + 1), rel=0.01)


def test_mfu_hand_computed():
    # 1e15 model FLOPs in 2 s on 4 GPUs of 250 TFLOP/s peak -> 0.5
    assert mfu(1e15, 2.0, 4, 250.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="seconds"):
        mfu(1e15, 0.0, 4, 250.0)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe", "fp8") == pytest.approx(1513.0)
    assert peak_tflops("Tesla T4") is None
    assert peak_tflops("NVIDIA H100 NVL") == pytest.approx(835.5)  # not the SXM part's peak
    assert peak_tflops("NVIDIA H100 NVL", compute_precision("bf16", fp8=True)) == 1670.5
    assert compute_precision("bf16", fp8=False) == "bf16"


def test_gpu_memory_metrics_report_allocated_and_reserved_peaks():
    got = gpu_memory_metrics((30.0, 41.0), (2.0, 3.5))
    assert got == {
        "perf/peak_gpu_mem_trainer_gb": 30.0, "perf/peak_gpu_reserved_trainer_gb": 41.0,
        "perf/peak_gpu_mem_rollout_gb": 2.0, "perf/peak_gpu_reserved_rollout_gb": 3.5,
        "perf/peak_gpu_mem_gb": 30.0, "perf/peak_gpu_reserved_gb": 41.0,
    }  # fmt: skip
    assert gpu_memory_metrics(None, None) == {}
    from megatron_armor.orchestration.actors.actor_handles import max_peak

    assert max_peak([(1.0, 5.0), None, (2.0, 3.0)]) == (2.0, 5.0)
    assert max_peak([None]) is None


def test_meter_step_metrics_and_reset():
    meter = ThroughputMeter(dims=TOY, num_gpus=2, peak_tflops_per_gpu=1e-6)
    meter.add_rollout(tokens=300, seconds=2.0)
    meter.add_train(seq_lens=[3, 3], seconds=1.0)
    meter.add_weight_sync(seconds=0.5, num_bytes=2_000_000_000)
    m = meter.pop_metrics()
    flops = training_flops(TOY, [3, 3])
    assert m["perf/rollout_tokens_per_s"] == 150.0
    assert m["perf/train_tokens_per_s"] == 6.0
    assert m["perf/train_tflops_per_gpu"] == pytest.approx(flops / 2 / 1e12)
    assert m["perf/mfu"] == pytest.approx(flops / (1.0 * 2 * 1e-6 * 1e12))
    assert m["perf/weight_sync_s"] == 0.5 and m["perf/weight_sync_gb"] == 2.0
    assert meter.pop_metrics() == {}
