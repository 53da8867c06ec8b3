"""The experts a real SGLang server routed each position to (gpu tier: needs CUDA and sglang;
skipped without sglang, deselected without CUDA).

SGLang 0.5.23 returns routes only on a GPU: ``--enable-return-routed-experts`` allocates their
host buffer with ``cudaHostRegister``, which fails without a CUDA driver (the sglang tier runs
the tiny MoE's weight pushes on CPU, ``tests/sglang_tier/test_moe_server.py``).

A random tiny Qwen3-MoE (routers with large weights: each token's top-2 is decided by a wide
margin, so fp32 rounding cannot flip a choice) is served fp32 by an ``SGLangEngine`` built for
routes, as a run with ``trainer.moe.routing_replay: r3`` builds it. Every sample's routes are
``[prompt + response - 1, layers, 2]`` and equal the top-2 of transformers' router logits over
the same tokens; after a disk push of new routers the routes follow the new weights.
"""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import load_file

from megatron_armor.config.schema import SGLangConfig
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang.engine import SGLangEngine

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
LAYERS, EXPERTS, TOPK = 2, 4, 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_tiny_moe(path, seed: int):
    """A random 2-layer Qwen3-MoE with wide router margins, saved fp32 at ``path``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, eos_token_id=1, pad_token_id=0, bos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(path)
    return model


def router_topk(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """``[positions, layers, k]`` top-k experts of transformers' routers over prompt +
    response (the last token is never fed back), sorted per position and layer."""
    ids = torch.tensor([prompt + response[:-1]])
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    per_layer = [
        logits.reshape(ids.shape[1], -1).topk(TOPK).indices for logits in out.router_logits
    ]
    return torch.stack(per_layer, dim=1).sort(dim=-1).values


def check_routes(engine, model) -> None:
    out = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=12))
    for prompt, group in zip(PROMPTS, out, strict=True):
        for s in group:
            routes = torch.from_numpy(s.routed_experts.array().astype("int64"))
            assert list(routes.shape) == [len(prompt) + len(s.token_ids) - 1, LAYERS, TOPK]
            expected = router_topk(model.cpu(), prompt, s.token_ids)
            assert torch.equal(routes.sort(dim=-1).values, expected)


def test_routes_of_a_moe_server_are_the_routers_top_k_and_follow_a_push(tmp_path):
    model = build_tiny_moe(tmp_path / "a", 0)
    cfg = SGLangConfig(num_engines=1, base_port=free_port(), router=False,
                       weight_transport="disk", startup_timeout_s=600)  # fmt: skip
    engine = SGLangEngine(str(tmp_path / "a"), cfg, weights_dir=str(tmp_path / "w"),
                          routes=(LAYERS, TOPK))  # fmt: skip
    try:
        engine.launch(colocated=False, log_dir=str(tmp_path / "logs"))
        check_routes(engine, model)
        moved = build_tiny_moe(tmp_path / "b", 1)  # new routers and experts, same shape
        tensors = load_file(str(tmp_path / "b" / "model.safetensors"))  # per-expert names
        engine.update_weights(sorted(tensors.items()), version=1)
        check_routes(engine, moved)
    finally:
        engine.close()
