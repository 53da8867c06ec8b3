"""The trainer ranks' weight transports into a real SGLang server, written once for the
``device`` fixture: on a GPU (gpu tier) the CUDA paths, on CPU (the sglang tier's virtualenv,
every CI run) the same tests with the CPU forms, the lines that need CUDA left out with their
reason. ``scripts/gpu_weight_sync_check.sh`` runs this file and the benchmark on a GPU node.

A one-rank megatron-core trainer (local spec; bf16 on the GPU, fp32 on gloo on CPU) holds tiny
Qwen2 model ``b``; one SGLang server starts on model ``a`` (on a GPU colocated, with the memory
saver and bf16 kernels; on CPU as ``orchestration.layout: cpu`` starts it) and answers only its
engine's API key, which every push carries. Per transport the server is first reset to ``a``
from disk and checked to serve it, then gets ``b`` from the trainer through the transport; its
log-probs must then match transformers' fp32 forward of ``b`` (a push that silently loads
nothing fails):

- the export stays on the trainer's device (no host copy on a GPU);
- a bucket serialized for ``/update_weights_from_tensor`` is rebuilt by SGLang's own code in
  an independent process as sent (a CUDA-IPC handle on a GPU, inline bytes on CPU);
- ``tensor``: ``TensorRankSync`` into the server (CUDA IPC on a GPU, the inline form on CPU);
- ``distributed``: ``DistributedRankSync`` over NCCL into a server on another GPU (NCCL refuses
  two ranks on one GPU: it needs two GPUs), over gloo on CPU;
- ``disk``: ``DiskRankSync`` shards loaded by the server;
- a colocated step without an update: the server releases its memory (the GPU's free memory
  grows), the trainer hands its memory over, the server takes back its weights' memory, a push
  at the same version fills it, the push's buffers are back with CUDA before the KV cache
  returns, and the server serves the weights.

Tolerance: on a GPU the server runs bf16 kernels (``|mean diff| < 0.05``, ``max < 0.5`` nats);
on CPU fp32, as the oracle (``1e-4`` / ``1e-3``: only the order of floating-point sums
differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from megatron_armor.net import free_port
from megatron_armor.rollout.protocol import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.own_process]
TEMPERATURE = 0.8  # != 1 so the log-prob convention (log_softmax(logits / T)) is checked
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
TOL = {"cuda": (0.05, 0.5), "cpu": (1e-4, 1e-3)}
"""``(mean, max)`` nats between the server's log-probs and the fp32 oracle's."""
BUCKET_MB = 1  # several buckets per push (the tiny model is ~1.2 MB in fp32)


def build_tiny_qwen2(path, seed: int) -> str:
    """A random 2-layer Qwen2 in bf16 with peaked, model-specific logits (a large init)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=1, pad_token_id=0, bos_token_id=2, tie_word_embeddings=False,
        initializer_range=0.1,
    )  # fmt: skip
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def server_config(device, **more):
    """The test server's ``SGLangConfig``: bf16 kernels without CUDA graphs on a GPU; the CPU
    server's arguments come from ``launch.CPU_SERVER_ARGS`` (``on_cpu``)."""
    from megatron_armor.config.schema import SGLangConfig

    extra = {"skip_tokenizer_init": True}
    if device.type == "cuda":
        extra.update(dtype="bfloat16", disable_cuda_graph=True)
    return SGLangConfig(num_engines=1, base_port=free_port(), router=False,
                        mem_fraction_static=0.3, startup_timeout_s=600, extra_args=extra,
                        **more)  # fmt: skip


def start_server(model_dir: str, device, log_dir, colocated: bool, gpu: int = 0):
    from megatron_armor.rollout.sglang.engine import SGLangEngine

    engine = SGLangEngine(model_dir, server_config(device), gpu_ids=[gpu],
                          on_cpu=device.type == "cpu")  # fmt: skip
    try:
        engine.launch(colocated=colocated and device.type == "cuda", log_dir=str(log_dir))
    except BaseException:
        engine.close()
        raise
    return engine


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, device):
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    root = tmp_path_factory.mktemp("weight_sync")
    a, b = build_tiny_qwen2(root / "a", 0), build_tiny_qwen2(root / "b", 1)
    cfg = ArmorConfig()
    t = cfg.trainer
    t.model_path, t.transformer_impl = b, "local"
    t.precision = "bf16" if device.type == "cuda" else "fp32"
    cfg.algo.alpha = 15 / 16  # a hand-built config: alpha as load resolves 'auto' for G = 16
    made = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
    yield {"trainer": made, "a": a, "b": b, "root": root}
    made.close()


@pytest.fixture(scope="module")
def served(trainer, device):
    engine = start_server(trainer["a"], device, trainer["root"] / "logs", colocated=True)
    yield engine
    engine.close()


def logprob_gap(model_dir: str, outputs) -> tuple[float, float]:
    """Mean and max ``|server - oracle|`` over every generated token (transformers, fp32)."""
    from megatron_armor.rollout.torch_engine import TorchEngine

    oracle, diffs = TorchEngine(model_dir), []
    for prompt, group in zip(PROMPTS, outputs, strict=True):
        for s in group:
            ref = oracle.teacher_forced_logprobs(prompt, s.token_ids, TEMPERATURE)
            diffs += [abs(x - y) for x, y in zip(ref, s.logprobs, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def check_serves(engine, model_dir: str, version: int, device) -> None:
    out = engine.generate(PROMPTS, 2, SamplingParams(temperature=TEMPERATURE, max_new_tokens=16))
    assert all(
        s.weight_version == version and len(s.token_ids) == len(s.logprobs) > 0
        for g in out
        for s in g
    )
    mean, worst = logprob_gap(model_dir, out)
    mean_tol, max_tol = TOL[device.type]
    assert mean < mean_tol and worst < max_tol, (mean, worst)


def serves_a_then_b(trainer, engine, push, version: int, device) -> None:
    """Reset the server to ``a`` from disk, ``push(version)`` the trainer's ``b``, check both."""
    engine.update_weights_from_disk(trainer["a"], version - 1)
    check_serves(engine, trainer["a"], version - 1, device)
    push(version)
    engine.set_weight_version(version)
    check_serves(engine, trainer["b"], version, device)


def in_session(engine, push):
    """``push`` inside the server's weight-update session, as the rollout worker opens and
    closes it around the trainer ranks' pushes (``orchestration/actors/weight_sync.SessionSync``)."""

    def pushed(version: int):
        engine.begin_weight_update()
        try:
            return push(version)
        finally:
            engine.end_weight_update()

    return pushed


def tensor_target(engine):
    """The colocated server as ``TensorRankSync`` addresses it, with its engine's API key."""
    from megatron_armor.trainer.weight_sync import ServerTarget

    return [ServerTarget(engine.servers[0].url, 1, 0, engine.api_key)]


def test_the_export_stays_on_the_trainers_device(trainer, device):
    named = list(trainer["trainer"].export_weights("policy", device=None, every_rank=True))
    assert named and all(t.device.type == device.type for _, t in named)


def rebuild(queue, blob: str, load_format: str | None) -> None:
    """The receiving end of ``/update_weights_from_tensor``, as SGLang's TP worker does it: a
    CUDA-IPC ``FlattenedTensorBucket``, or named tensors inline (``load_format`` ``None``)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()
    data = MultiprocessingSerializer.deserialize(blob)
    if load_format == "flattened_bucket":
        bucket = FlattenedTensorBucket(
            flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
        )
        data = bucket.reconstruct_tensors()
    queue.put({name: t.float().sum().item() for name, t in data})


def test_a_bucket_round_trips_into_another_process(trainer, device):
    from megatron_armor.rollout.sglang.weights import serialize_bucket

    named = list(trainer["trainer"].export_weights("policy", device=None, every_rank=True))
    serialized = serialize_bucket(named)
    assert serialized.load_format == ("flattened_bucket" if device.type == "cuda" else None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=rebuild, args=(queue, serialized.text, serialized.load_format))
    process.start()
    try:
        sums = queue.get(timeout=300)
    finally:
        process.join(timeout=60)
    assert sums == {name: t.float().sum().item() for name, t in named}
    del serialized


def test_tensor_transport_into_sglang(trainer, served, device):
    from megatron_armor.trainer.weight_sync import TensorRankSync

    sync = TensorRankSync(trainer["trainer"], bucket_mb=BUCKET_MB)
    target = tensor_target(served)
    try:
        push = in_session(served, lambda v: sync.push(v, "policy", "policy", target))
        serves_a_then_b(trainer, served, push, 21, device)
    finally:
        sync.close()


def test_distributed_transport_into_sglang(trainer, served, device, cuda_only):
    """On CPU into the test's server over gloo; on a GPU into a second server on GPU 1 over
    NCCL (NCCL refuses a group with two ranks on one GPU)."""
    from megatron_armor.trainer.weight_sync import DistributedRankSync, ServerTarget

    engine = served
    if cuda_only("NCCL: a server on another GPU than the trainer's"):
        if torch.cuda.device_count() < 2:
            pytest.skip("NCCL refuses two ranks on one GPU: this node has one (config/validate.py)")
        engine = start_server(trainer["a"], device, trainer["root"] / "logs-gpu1", False, gpu=1)
    sync = DistributedRankSync(trainer["trainer"], bucket_mb=BUCKET_MB, address="127.0.0.1")
    target = [ServerTarget(engine.servers[0].url, 1, api_key=engine.api_key)]
    try:
        push = in_session(engine, lambda v: sync.push(v, "policy", "policy", target))
        serves_a_then_b(trainer, engine, push, 31, device)
    finally:
        sync.close()
        if engine is not served:
            engine.close()


def test_disk_transport_into_sglang(trainer, served, device):
    from megatron_armor.trainer.weight_sync import DiskRankSync

    sync = DiskRankSync(trainer["trainer"], BUCKET_MB, trainer["b"])
    out = str(trainer["root"] / "pushed")

    def push(version: int) -> None:
        sync.push(version, "policy", "policy", out)
        served.update_weights_from_disk(out, version)

    serves_a_then_b(trainer, served, push, 41, device)


def test_released_weights_come_back_by_a_push_at_the_same_version(
    trainer, served, device, cuda_only
):
    """A colocated step without an update (docs/weight-sync.md, "A step without an update"), in
    the loop's order: the server releases its weights and KV cache (no host copy); the trainer
    hands its memory over; the server takes back its weights' memory (without contents) and
    the trainer pushes the current weights again, at the version the server had; the push's
    buffers are back with CUDA when it returns; then the KV cache returns and the server
    serves the pushed weights."""
    from megatron_armor.trainer.weight_sync import TensorRankSync

    sync = TensorRankSync(trainer["trainer"], bucket_mb=BUCKET_MB)
    target = tensor_target(served)
    push = in_session(served, lambda v: sync.push(v, "policy", "policy", target))
    on_gpu = cuda_only("the GPU's free memory and the caching allocator's cached bytes")
    try:
        push(51)
        served.set_weight_version(51)
        check_serves(served, trainer["b"], 51, device)
        free_before = torch.cuda.mem_get_info()[0] if on_gpu else 0
        served.release_memory()  # weights and KV cache, named (never the CUDA graphs)
        if on_gpu:
            assert torch.cuda.mem_get_info()[0] > free_before
        trainer["trainer"].hand_over_memory()
        served.resume_memory(["weights"])
        reserved = torch.cuda.memory_reserved() if on_gpu else 0
        push(51)
        if on_gpu:  # the buckets and gathered tensors went back before the KV cache returns
            assert torch.cuda.memory_reserved() <= reserved + 2 * 2**20
        served.resume_memory(["kv_cache"])
        check_serves(served, trainer["b"], 51, device)
    finally:
        sync.close()
