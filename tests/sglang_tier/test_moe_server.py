"""The tiny Qwen3-MoE on the real SGLang server (sglang tier, CPU): expert weights in SGLang's
names by every transport.

SGLang 0.5.23 serves the tiny Qwen3-MoE (``armor tiny --moe``) on CPU and loads its experts
through ``Qwen3MoeForCausalLM.load_weights``, which takes the per-expert HF names the trainer
exports (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, the router
``mlp.gate.weight``) into its fused ``FusedMoE`` parameters. Each push here replaces the
router and every expert (the rest unchanged) by weights whose log-probs differ from the
previous ones by far more than the tolerance, so an expert that did not arrive fails the
comparison with transformers' fp32 forward of the same tensors.

The experts each position was routed to (``--enable-return-routed-experts``) are not served on
CPU: SGLang allocates their host buffer with ``cudaHostRegister``
(``mem_cache/pool_host/common.py``), which fails without a CUDA driver; the gpu tier checks
them (``tests/gpu/test_sglang_moe_gpu.py``).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from sglang_servers import (
    MAX_TOL,
    MEAN_TOL,
    PROMPTS,
    cpu_servers,
    logprob_gap,
    oracle,
    perturbed,
    push_distributed,
    push_tensor_inline,
    sample,
)

pytestmark = pytest.mark.sglang
BUCKET = 256 << 10  # several buckets per push


def new_experts(base, seed: int):
    """``base`` with the router and every expert of every layer replaced (the rest as is)."""
    moved = dict(perturbed([(n, t) for n, t in base if ".mlp." in n], seed))
    return [(n, moved.get(n, t)) for n, t in base]


def push_disk(engine, tensors, version: int) -> None:
    engine.update_weights(tensors, version=version)  # an HF dir, /update_weights_from_disk


def push_gloo(engine, tensors, version: int) -> None:
    push_distributed(engine, tensors, version, "armor-moe-pp0", BUCKET)


def push_tensor(engine, tensors, version: int) -> None:
    push_tensor_inline(engine, tensors, version, BUCKET)


def test_moe_server_takes_expert_weights_by_every_transport(tiny_moe_dir, tmp_path):
    model = tiny_moe_dir / "model"
    base = sorted(load_file(str(model / "model.safetensors")).items())
    assert any(".mlp.experts.3.down_proj." in n for n, _ in base)  # per-expert, as exported
    with cpu_servers(model, tmp_path) as engine:
        mean, worst = logprob_gap(oracle(model), PROMPTS, sample(engine))
        assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)
        previous = base
        for version, push in enumerate((push_disk, push_gloo, push_tensor), start=1):
            tensors = new_experts(base, seed=version)
            push(engine, tensors, version)
            out = sample(engine)
            assert {s.weight_version for g in out for s in g} == {version}, push.__name__
            mean, worst = logprob_gap(oracle(model, tensors), PROMPTS, out)
            assert mean < MEAN_TOL and worst < MAX_TOL, (push.__name__, mean, worst)
            stale, _ = logprob_gap(oracle(model, previous), PROMPTS, out)
            assert stale > 100 * MEAN_TOL, (push.__name__, stale)
            previous = tensors
