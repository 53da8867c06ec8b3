"""The experts a real SGLang server routed each position to, written once for the ``device``
fixture (gpu tier with CUDA; on CPU, in the sglang tier, the oracle's part runs and the server's
is left out with its reason).

SGLang 0.5.23 returns routes only on a GPU: ``--enable-return-routed-experts`` allocates their
host buffer with ``cudaHostRegister``, which fails without a CUDA driver (the sglang tier runs
the tiny MoE's weight pushes on CPU, ``tests/sglang_tier/test_moe_server.py``).

A random tiny Qwen3-MoE (routers with large weights: each token's top-2 is decided by a wide
margin, so the server's kernels cannot flip a choice; checked on every device) is served in
fp32 (``--dtype float32``: SGLang's ``auto`` would serve the fp32 checkpoint in fp16) by an
``SGLangEngine`` built for routes, as a run with ``trainer.moe.routing_replay: r3`` builds it.
Every sample's routes are ``[prompt + response - 1, layers, 2]`` and equal the top-2 of
transformers' router logits over the same tokens; after a disk push of new routers the routes
follow the new weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_armor.config.schema import SGLangConfig
from megatron_armor.net import free_port
from megatron_armor.rollout.protocol import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
LAYERS, EXPERTS, TOPK = 2, 4, 2
MARGIN = 1e-3
"""Smallest gap between a position's 2nd and 3rd router logits: two orders of magnitude above
the differences of fp32 kernels (~1e-5)."""


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


def router_logits(model, tokens: list[int]) -> torch.Tensor:
    """``[positions, layers, experts]`` router logits of transformers' forward over ``tokens``."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    return torch.stack([g.reshape(ids.shape[1], -1) for g in out.router_logits], dim=1)


def router_topk(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """``[positions, layers, k]`` top-k experts over prompt + response (the last token is
    never fed back), sorted per position and layer."""
    return router_logits(model, prompt + response[:-1]).topk(TOPK).indices.sort(dim=-1).values


def check_routes(engine, model) -> None:
    out = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=12))
    for prompt, group in zip(PROMPTS, out, strict=True):
        for s in group:
            routes = torch.from_numpy(s.routed_experts.array().astype("int64"))
            assert list(routes.shape) == [len(prompt) + len(s.token_ids) - 1, LAYERS, TOPK]
            expected = router_topk(model.cpu(), prompt, s.token_ids)
            assert torch.equal(routes.sort(dim=-1).values, expected)


def test_routes_of_a_moe_server_are_the_routers_top_k_and_follow_a_push(tmp_path, cuda_only):
    model = build_tiny_moe(tmp_path / "a", 0)
    moved = build_tiny_moe(tmp_path / "b", 1)  # new routers and experts, same shape
    tokens = list(range(3, 200))
    for m in (model, moved):  # the premise: no near-tie the server's kernels could flip
        top = router_logits(m, tokens).sort(dim=-1, descending=True).values
        assert float((top[..., TOPK - 1] - top[..., TOPK]).min()) > MARGIN
    if not cuda_only("SGLang returns routes only with CUDA (cudaHostRegister)"):
        return
    from megatron_armor.rollout.sglang.engine import SGLangEngine

    cfg = SGLangConfig(num_engines=1, base_port=free_port(), router=False,
                       weight_transport="disk", mem_fraction_static=0.3, startup_timeout_s=600,
                       extra_args={"dtype": "float32", "skip_tokenizer_init": True,
                                   "disable_cuda_graph": True})  # fmt: skip
    engine = SGLangEngine(str(tmp_path / "a"), cfg, weights_dir=str(tmp_path / "w"),
                          routes=(LAYERS, TOPK))  # fmt: skip
    try:
        engine.launch(colocated=False, log_dir=str(tmp_path / "logs"))
        check_routes(engine, model)
        tensors = load_file(str(tmp_path / "b" / "model.safetensors"))  # per-expert names
        engine.update_weights(sorted(tensors.items()), version=1)
        check_routes(engine, moved)
    finally:
        engine.close()
