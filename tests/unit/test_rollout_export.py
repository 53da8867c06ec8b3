"""Megatron export -> embedded engine update == loading the HF directory directly (dist tier:
one megatron-core trainer rank on gloo in a subprocess, bounded by a timeout).

Also checks the engine's sampling log-probs against the trainer's own ``compute_logprobs``
at the rollout temperature (the quantity the ARMOR ratios are built from): tolerance 1e-4
in fp32 (two implementations: HF transformers vs megatron-core local spec).

Run as a script (``python this_file.py MODEL_DIR SAMPLES OUT PORT``) it is the trainer rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_armor.net import free_port
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.torch_engine import TorchEngine
from megatron_armor.types import Group, Sample, pack_groups

pytestmark = [pytest.mark.dist, pytest.mark.usefixtures("one_torch_thread")]


REPO = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


def build_tiny_qwen2(path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # non-trivial norms and biases, so a mis-mapped tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


def samples_batch(samples: list[tuple[list[int], list[int]]]):
    groups = [
        Group(f"q{i}", [Sample(f"q{i}", p, r)], advantages=[0.0])
        for i, (p, r) in enumerate(samples)
    ]
    return pack_groups(groups)


def trainer_main(model_dir: str, samples_path: str, out_path: str, port: int) -> None:
    """The trainer rank: export the HF weights and compute log-probs of the engine samples."""
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.config.validate import validate
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    cfg = ArmorConfig()
    cfg.trainer.model_path, cfg.trainer.precision = model_dir, "fp32"
    cfg.rollout.sampling.temperature = TEMPERATURE
    cfg.data.max_prompt_len, cfg.rollout.sampling.max_new_tokens = 64, 64  # the tiny model's 128
    validate(cfg)  # the trainer takes a validated config (alpha resolved)
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", port)
    try:
        batch = samples_batch(torch.load(samples_path))
        exported = {name: t.detach().clone() for name, t in trainer.export_weights()}
        torch.save({"weights": exported, "logprobs": trainer.compute_logprobs(batch)}, out_path)
    finally:
        trainer.close()


@pytest.mark.timeout(300)
def test_megatron_export_into_engine_matches_hf_dir(tmp_path):
    model_dir = build_tiny_qwen2(tmp_path / "model")
    direct = TorchEngine(model_dir)
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=10, seed=0)
    outputs = direct.generate(PROMPTS, 2, params)
    samples = [(p, s.token_ids) for p, g in zip(PROMPTS, outputs, strict=True) for s in g]
    torch.save(samples, tmp_path / "samples.pt")
    cmd = [
        sys.executable,
        __file__,
        model_dir,
        str(tmp_path / "samples.pt"),
        str(tmp_path / "out.pt"),
        str(free_port()),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")

    # Engine loaded from different weights, then updated with the Megatron export.
    updated = TorchEngine(build_tiny_qwen2_other(tmp_path / "other"))
    updated.update_weights(result["weights"].items(), version=1)
    assert set(result["weights"]) <= set(updated.parameter_names())
    for (prompt, response), sample in zip(samples, [s for g in outputs for s in g], strict=True):
        via_export = updated.teacher_forced_logprobs(prompt, response, TEMPERATURE)
        via_hf_dir = direct.teacher_forced_logprobs(prompt, response, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(via_export, via_hf_dir, strict=True)) < 1e-5
        assert max(abs(a - b) for a, b in zip(via_export, sample.logprobs, strict=True)) < 1e-5
    regenerated = updated.generate(PROMPTS, 2, params)
    assert [[s.token_ids for s in g] for g in regenerated] == [
        [s.token_ids for s in g] for g in outputs
    ]

    # The trainer's own log-probs of the engine's samples (what the ARMOR ratios use).
    batch = samples_batch(samples)
    trainer_lp = result["logprobs"][batch.loss_mask.bool()]
    engine_lp = torch.tensor([lp for g in outputs for s in g for lp in s.logprobs])
    assert torch.allclose(trainer_lp, engine_lp, atol=1e-4), (trainer_lp - engine_lp).abs().max()


def build_tiny_qwen2_other(path) -> str:
    """Same architecture, different random weights."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    torch.manual_seed(11)
    config = AutoConfig.from_pretrained(path.parent / "model")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    trainer_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
