"""A real SGLang server on a tiny model (gpu tier: needs CUDA, sglang and sglang-router;
skipped without sglang, deselected without CUDA).

Launches ``sglang.launch_server`` on a random 2-layer Qwen2 saved in a temp dir, generates
with log-probs, updates the weights (``distributed``: an NCCL group from this process;
``disk``: an HF dir; the trainer ranks' transports in ``test_weight_sync_gpu.py``), and checks
SGLang's log-probs against teacher-forced log-probs of the same weights computed by
transformers in fp32 (``TorchEngine``, which the Megatron export test ties to the trainer).

Tolerance: the server runs bf16 kernels (``--dtype bfloat16``), so per-token log-probs are
compared with ``|mean diff| < 0.05`` and ``max diff < 0.5`` nats, and a weight update must
move them by far more than that.
"""

from __future__ import annotations

import socket

import pytest
import torch

from megatron_armor.config.schema import SGLangConfig
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang.distributed import DistributedWeightSender
from megatron_armor.rollout.sglang.engine import SGLangEngine
from megatron_armor.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang")

TEMPERATURE = 0.8  # != 1 so the log-prob convention (log_softmax(logits / T)) is checked
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
MEAN_TOL, MAX_TOL = 0.05, 0.5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_tiny_qwen2(path, seed: int, init_range: float = 0.02) -> str:
    """A random 2-layer Qwen2; a larger ``init_range`` gives peaked, model-specific logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=1, pad_token_id=0, bos_token_id=2, tie_word_embeddings=False,
        initializer_range=init_range,
    )  # fmt: skip
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    a, b = build_tiny_qwen2(root / "a", 0), build_tiny_qwen2(root / "b", 1)
    cfg = SGLangConfig(
        num_engines=1, base_port=free_port(), router=False, mem_fraction_static=0.3, startup_timeout_s=600,
        extra_args={"skip_tokenizer_init": True, "dtype": "bfloat16", "disable_cuda_graph": True},
    )  # fmt: skip
    engine = SGLangEngine(a, cfg, weights_dir=str(root / "weights"))
    engine.launch(colocated=True, log_dir=str(root))
    yield {"engine": engine, "a": a, "b": b}
    engine.close()


def logprob_gap(oracle: TorchEngine, outputs) -> tuple[float, float]:
    diffs = []
    for prompt, group in zip(PROMPTS, outputs, strict=True):
        for s in group:
            ref = oracle.teacher_forced_logprobs(prompt, s.token_ids, TEMPERATURE)
            diffs += [abs(x - y) for x, y in zip(ref, s.logprobs, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def check_serves(served, model_dir: str, version: int) -> None:
    out = served["engine"].generate(
        PROMPTS, 2, SamplingParams(temperature=TEMPERATURE, max_new_tokens=16)
    )
    assert all(
        s.weight_version == version and len(s.token_ids) == len(s.logprobs) > 0
        for g in out
        for s in g
    )
    mean, worst = logprob_gap(TorchEngine(model_dir), out)
    assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)


def test_generate_logprobs_match_the_hf_model(served):
    check_serves(served, served["a"], version=0)
    assert served["engine"].health()


def test_weight_update_from_tensors_saved_here(served):
    """``SGLangEngine.update_weights`` (tensors held by this process: saved as an HF dir and
    loaded from disk); the trainer ranks' transports are in ``test_weight_sync_gpu.py``."""
    engine = served["engine"]
    engine.cfg.weight_transport = "disk"
    tensors = [
        (n, t.to("cuda", torch.bfloat16)) for n, t in TorchEngine(served["a"]).state_tensors()
    ]
    engine.update_weights(tensors, version=11)
    check_serves(served, served["a"], version=engine.weight_version())


def test_weight_update_by_nccl_broadcast(served):
    engine = served["engine"]
    targets = [(s.url, s.tp) for s in engine.servers]
    sender = DistributedWeightSender(
        targets, "127.0.0.1", free_port(), "armor-test-pp0", bucket_bytes=1 << 20
    )
    try:
        sender.connect(timeout_s=300)
        tensors = [
            (n, t.to("cuda", torch.bfloat16)) for n, t in TorchEngine(served["b"]).state_tensors()
        ]
        engine.begin_weight_update()  # SGLang 0.5.23 takes streamed updates in a session only
        try:
            sender.send(tensors, version=12)
        finally:
            engine.end_weight_update()
        engine.set_weight_version(12)
        check_serves(served, served["b"], version=12)
    finally:
        sender.close()


def test_release_and_resume_memory(served):
    engine = served["engine"]
    free_before = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    assert torch.cuda.mem_get_info()[0] > free_before
    engine.resume_memory()
    check_serves(served, served["b"], version=engine.weight_version())


def test_router_in_front_of_two_engines(tmp_path):
    pytest.importorskip("sglang_router")
    model = build_tiny_qwen2(tmp_path / "m", 0)
    cfg = SGLangConfig(num_engines=2, base_port=free_port(), router=True, router_port=free_port(),
                       mem_fraction_static=0.2, extra_args={"skip_tokenizer_init": True})  # fmt: skip
    engine = SGLangEngine(model, cfg, gpu_ids=[i % torch.cuda.device_count() for i in range(2)])
    try:
        engine.launch(colocated=False, log_dir=str(tmp_path))
        out = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=8))
        assert [len(g) for g in out] == [4, 4, 4]
        assert all(s.finish_reason in ("stop", "length") for g in out for s in g)
    finally:
        engine.close()


def test_dedicated_reference_pool_samples_anchors_from_reference_weights(tmp_path):
    """Two pools on one GPU as ``rollout.ref_strategy: dedicated`` runs them colocated: the
    policy servers on model ``a``, the reference pool (its flag derived from its share of the
    GPU) loaded with model ``b`` by the sampler; anchors carry ``b``'s log-probs."""
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.rollout.reference import make_reference_sampler

    a, b = build_tiny_qwen2(tmp_path / "a", 0, 0.1), build_tiny_qwen2(tmp_path / "b", 1, 0.1)
    config = ArmorConfig()
    config.trainer.model_path, config.run.output_dir = a, str(tmp_path / "runs")
    config.rollout.backend, config.rollout.ref_strategy = "sglang", "dedicated"
    config.orchestration.layout, config.trainer.world_size = "colocated", 1
    sg = config.rollout.sglang
    sg.base_port, sg.router, sg.mem_fraction_static, sg.startup_timeout_s = (
        free_port(), False, 0.3, 600,
    )  # fmt: skip
    sg.extra_args = {"skip_tokenizer_init": True, "dtype": "bfloat16", "disable_cuda_graph": True}
    sg.ref_pool.base_port, sg.ref_pool.mem_fraction = free_port(), 0.2
    policy = SGLangEngine.from_config(config, "policy")
    try:
        ref = SGLangEngine.from_config(config, "ref")
        try:
            sampler = make_reference_sampler("dedicated", policy, ref_engine=ref)
            tensors = [(n, t.to("cuda", torch.bfloat16)) for n, t in TorchEngine(b).state_tensors()]
            sampler.load_reference(3, lambda: iter(tensors))
            params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=16)
            anchors = sampler.sample(["q0", "q1", "q2"], PROMPTS, 2, params)
            assert all(s.weight_version == 3 for g in anchors for s in g)
            mean, worst = logprob_gap(TorchEngine(b), anchors)
            assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)
            own = policy.generate(PROMPTS, 2, params)  # the policy pool still serves `a`
            mean, worst = logprob_gap(TorchEngine(a), own)
            assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)
            mean_other, _ = logprob_gap(TorchEngine(a), anchors)
            assert mean_other > 4 * max(mean, MEAN_TOL)  # the anchors are not the policy's
        finally:
            ref.close()
    finally:
        policy.close()
