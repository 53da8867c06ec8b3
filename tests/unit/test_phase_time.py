"""Unit tier: the planner's predicted phase times (``planner/phase_time.py``) against
hand-computed cases, and ``armor plan`` printing them for the paper's configs and the MoE
config with their assumptions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_armor.cli import main as armor_main
from megatron_armor.config import load_config
from megatron_armor.planner.devices import (
    GPU_PEAKS,
    DevicePeaks,
    cpu_flops_per_core,
    cpu_peaks,
    gpu_peaks,
)
from megatron_armor.planner.flops import forward_flops
from megatron_armor.planner.model import PRESETS, ModelDims
from megatron_armor.planner.phase_time import (
    Efficiency,
    Layout,
    WorkloadGuess,
    check_assumptions,
    decode_bytes,
    measured_workload,
    parse_assumptions,
    pass_seconds,
    planned_workload,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TOY = ModelDims("toy", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn_hidden=16, vocab=10)
ONE_GPU = Layout(trainer_devices=2, engines=1, engine_tp=1, kv_tokens=1e9, transport="tensor",
                 nodes=1, precision="bf16")  # fmt: skip
DEVICE = DevicePeaks("unit", {"bf16": 100.0}, memory_gbps=1000.0, link_gbps=400.0)


def test_device_table_knows_the_h100_parts():
    assert gpu_peaks("NVIDIA H100 80GB HBM3") is GPU_PEAKS["H100 SXM"]
    assert GPU_PEAKS["H100 SXM"].memory_gbps == 3350.0 and GPU_PEAKS["H200"].memory_gbps == 4800.0
    assert gpu_peaks("Tesla T4") is None


def test_a_cpus_nominal_rate_is_its_clock_times_its_vector_units():
    assert cpu_flops_per_core("cpu MHz\t: 2500.0\nflags\t: fpu sse2 avx2 fma\n") == 2.5e9 * 32
    assert cpu_flops_per_core("cpu MHz\t: 2000.0\nflags\t: fpu sse2\n") == 2e9 * 8
    assert cpu_flops_per_core("processor : 0\n") == 0.0  # no clock or flags: unknown
    peaks = cpu_peaks(2, "cpu MHz : 2500.0\nflags : avx512f\n", copy=10.0)
    assert (
        peaks.tflops == {"fp32": 0.16} and peaks.memory_gbps == 20.0 and "nominal" in peaks.source
    )


def test_decode_bytes_by_hand():
    # 4 sequences of 10 prompt + 6 response tokens, longest 6: all fit, 6 iterations
    weights = TOY.total_params() * 2
    kv_per_token = 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 kv head of 4, bf16
    kv = 4 * 6 * (10 + 6 / 2) * kv_per_token
    assert decode_bytes(TOY, ONE_GPU, 4, 10, 6, 6) == pytest.approx(6 * weights + kv)
    # a KV cache of 32 tokens holds 2 of them: 4 * 6 tokens / 2 at a time = 12 iterations
    small = Layout(**{**vars(ONE_GPU), "kv_tokens": 32.0})
    assert decode_bytes(TOY, small, 4, 10, 6, 6) == pytest.approx(12 * weights + kv)


def test_moe_decode_reads_the_experts_its_tokens_touch():
    moe = PRESETS["qwen3-30b-a3b"]
    one = decode_bytes(moe, Layout(**{**vars(ONE_GPU), "kv_tokens": 1.0}), 1, 1, 1, 1)
    many = decode_bytes(moe, ONE_GPU, 512, 1, 1, 1)
    dense = (moe.total_params() - moe.decoder_expert_params()) * 2
    # one sequence: its k experts of E per layer; 512: nearly every expert
    assert one == pytest.approx(dense + moe.decoder_expert_params() * 2 * 8 / 128, rel=1e-3)
    kv_per_token = 2 * 48 * 4 * 128 * 2
    assert many == pytest.approx(moe.total_params() * 2 + 512 * 1.5 * kv_per_token, rel=1e-6)


def test_pass_seconds_by_hand():
    flops = 3 * 16 * forward_flops(TOY, 100)
    expected = flops / (2 * 100e12 * 0.5)
    assert pass_seconds(TOY, DEVICE, ONE_GPU, 16, 100, 3, 0.5) == pytest.approx(expected)


def test_planned_workload_follows_the_config_and_the_guess():
    config = load_config(REPO / "configs" / "paper" / "qwen25_math_7b_armor.yaml")
    work = planned_workload(config, WorkloadGuess(acceptance=0.125))
    # B / acceptance = 4096 queries = 2 generation batches of 2048; 15 policy samples each
    assert work.policy_sequences == 4096 * 15 and work.policy_decode_steps == 2 * 8192
    assert work.reference_sequences == 4096 * 0.6 * 4 and work.trained_sequences == 512 * 16
    assert work.validations == 1 / 10 and work.resets == 1 / 160


def test_measured_workload_reads_the_step_line():
    config = load_config(REPO / "configs" / "tiny_cpu.yaml")
    record = {"rollout/policy_sequences": 56.0, "rollout/reference_sequences": 8.0,
              "rollout/prompt_tokens": 640.0, "length/policy_mean": 20.0,
              "rollout/generated_tokens": 56 * 20 + 8 * 30, "anchor/kept": 8.0,
              "train/prompt_tokens": 640.0, "train/response_tokens": 1280.0,
              "rollout/policy_decode_steps": 40.0, "val/val/n": 256.0, "timing/checkpoint_s": 1.0}  # fmt: skip
    work = measured_workload(record, config)
    assert (work.prompt_len, work.reference_response_len) == (10.0, 30.0)
    assert work.trained_sequences == 64 and work.trained_len == 30.0
    assert work.validation_sequences == 256 * 4 and work.checkpoints == 1.0 and work.resets == 0.0


def test_assumptions_parse_into_both_kinds_and_bad_ones_are_named():
    items = ["train_mfu=0.2", "acceptance=0.3"]
    check_assumptions(items)
    assert parse_assumptions(items, Efficiency).train_mfu == 0.2
    assert parse_assumptions(items, WorkloadGuess).acceptance == 0.3
    with pytest.raises(ValueError, match="NAME one of"):
        check_assumptions(["mfu=0.2"])
    with pytest.raises(ValueError, match="positive number"):
        check_assumptions(["train_mfu=-1"])


PLANS = [
    ("paper/qwen25_math_7b_armor.yaml", "qwen2.5-math-7b"),
    ("paper/qwen3_8b_base_armor.yaml", "qwen3-8b"),
    ("moe/qwen3_30b_a3b_4x8_h100.yaml", "qwen3-30b-a3b"),
]


@pytest.mark.parametrize("config,model", PLANS)
def test_armor_plan_prints_phase_times_with_their_assumptions(config, model, capsys):
    args = ["plan", str(REPO / "configs" / config), "--model", model]
    assert armor_main([*args, "--json"]) in (0, 1)
    times = json.loads(capsys.readouterr().out)["phase_times"]
    seconds = times["seconds"]
    assert times["device"]["name"] == "H100 SXM"
    for phase in ("rollout/policy", "logprobs", "train", "weight_sync", "checkpoint"):
        assert seconds[phase] > 0, phase
    assert seconds["reward"] == 0 and seconds["driver"] == 0  # measured only
    assert armor_main([*args, "--assume", "train_mfu=0.175"]) in (0, 1)
    text = capsys.readouterr().out
    assert "predicted step on H100 SXM" in text and "train_mfu=0.175" in text
    slower = float(text.split("  train ")[1].split()[0])
    assert slower == pytest.approx(2 * seconds["train"], rel=1e-3)  # half the MFU, twice the time


def test_armor_plan_refuses_an_unknown_assumption_and_device(capsys):
    config = str(REPO / "configs" / "paper" / "qwen25_math_7b_armor.yaml")
    assert armor_main(["plan", config, "--model", "qwen2.5-math-7b", "--assume", "mfu=1"]) == 2
    assert "NAME one of" in capsys.readouterr().err
    assert armor_main(["plan", config, "--model", "qwen2.5-math-7b", "--device", "T4"]) == 2
    assert "not in the peak table" in capsys.readouterr().err
