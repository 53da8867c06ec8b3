"""The trainer ranks' weight transports on a GPU (gpu tier: CUDA; the SGLang parts skip
without sglang). ``scripts/gpu_weight_sync_check.sh`` runs this file and the benchmark.

A one-rank megatron-core trainer (local spec, bf16, on the GPU) holds tiny Qwen2 model ``b``;
an SGLang server starts on model ``a``. Per transport the server is first reset to ``a`` from
disk, then gets ``b`` from the trainer through the transport; its log-probs must match ``b``'s
(``test_sglang_server.check_serves``):

- the export stays on the trainer's GPU (no host copy);
- ``tensor``: a CUDA-IPC bucket rebuilt in an independent process equals the source, and
  ``TensorRankSync`` into the server (``/update_weights_from_tensor``);
- ``distributed``: ``DistributedRankSync`` over an NCCL group into the server;
- ``disk``: ``DiskRankSync`` shards loaded by the server;
- a colocated step without an update: released weights come back by a push at the same version.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


def sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_armor_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.trainer.megatron_trainer import MegatronTrainer

    pytest.importorskip("sglang")
    server = sibling("test_sglang_server")
    root = tmp_path_factory.mktemp("weight_sync")
    a, b = server.build_tiny_qwen2(root / "a", 0, 0.1), server.build_tiny_qwen2(root / "b", 1, 0.1)
    cfg = ArmorConfig()
    cfg.trainer.model_path, cfg.trainer.precision, cfg.trainer.transformer_impl = b, "bf16", "local"
    cfg.algo.alpha = 15 / 16  # a hand-built config: alpha as load resolves 'auto' for G = 16
    made = MegatronTrainer(cfg, 0, 1, "127.0.0.1", server.free_port())
    yield {"trainer": made, "a": a, "b": b, "root": root, "server": server}
    made.close()


@pytest.fixture(scope="module")
def served(trainer):
    from megatron_armor.config.schema import SGLangConfig
    from megatron_armor.rollout.sglang.engine import SGLangEngine

    cfg = SGLangConfig(
        num_engines=1, base_port=trainer["server"].free_port(), router=False,
        mem_fraction_static=0.3, startup_timeout_s=600,
        extra_args={"skip_tokenizer_init": True, "dtype": "bfloat16", "disable_cuda_graph": True},
    )  # fmt: skip
    engine = SGLangEngine(trainer["a"], cfg)
    engine.launch(colocated=True, log_dir=str(trainer["root"]))
    yield {"engine": engine}
    engine.close()


def serves_a_then_b(trainer, served, push, version: int) -> None:
    """Reset the server to ``a`` from disk, ``push(version)`` the trainer's ``b``, check both."""
    engine, check = served["engine"], trainer["server"].check_serves
    engine.update_weights_from_disk(trainer["a"], version - 1)
    check(served, trainer["a"], version - 1)
    push(version)
    engine.set_weight_version(version)
    check(served, trainer["b"], version)


def test_the_export_stays_on_the_trainers_gpu(trainer):
    named = list(trainer["trainer"].export_weights("policy", device=None, every_rank=True))
    assert named and all(t.is_cuda for _, t in named)


def rebuild(queue, blob: str) -> None:
    """The receiving end of a CUDA-IPC bucket, as SGLang's TP worker does it."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()
    data = MultiprocessingSerializer.deserialize(blob)
    bucket = FlattenedTensorBucket(
        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
    )
    queue.put({name: t.float().sum().item() for name, t in bucket.reconstruct_tensors()})


def test_a_cuda_ipc_bucket_round_trips_into_another_process(trainer):
    from megatron_armor.rollout.sglang.weights import serialize_bucket

    named = list(trainer["trainer"].export_weights("policy", device=None, every_rank=True))
    serialized = serialize_bucket(named)  # on a GPU: the CUDA-IPC form
    assert serialized.load_format == "flattened_bucket"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=rebuild, args=(queue, serialized.text))
    process.start()
    sums = queue.get(timeout=300)
    process.join(timeout=60)
    assert sums == {name: t.float().sum().item() for name, t in named}
    del serialized


def in_session(served, push):
    """``push`` inside the server's weight-update session, as the rollout worker opens and
    closes it around the trainer ranks' pushes (``orchestration/actors/weight_sync.SessionSync``)."""

    def pushed(version: int):
        served["engine"].begin_weight_update()
        try:
            return push(version)
        finally:
            served["engine"].end_weight_update()

    return pushed


def test_tensor_transport_into_sglang(trainer, served):
    from megatron_armor.trainer.weight_sync import ServerTarget, TensorRankSync

    sync = TensorRankSync(trainer["trainer"], bucket_mb=1)
    url = served["engine"].servers[0].url
    try:
        serves_a_then_b(
            trainer, served, in_session(served, lambda v: sync.push(v, "policy", "policy",
                                                                   [ServerTarget(url, 1, 0)])), 21,
        )  # fmt: skip
    finally:
        sync.close()


def test_distributed_transport_into_sglang(trainer, served):
    from megatron_armor.trainer.weight_sync import DistributedRankSync, ServerTarget

    sync = DistributedRankSync(trainer["trainer"], bucket_mb=1, address="127.0.0.1")
    url = served["engine"].servers[0].url
    try:
        serves_a_then_b(
            trainer, served,
            in_session(served, lambda v: sync.push(v, "policy", "policy", [ServerTarget(url, 1)])),
            31,
        )  # fmt: skip
    finally:
        sync.close()


def test_disk_transport_into_sglang(trainer, served):
    from megatron_armor.trainer.weight_sync import DiskRankSync

    sync = DiskRankSync(trainer["trainer"], 1, trainer["b"])
    out = str(trainer["root"] / "pushed")

    def push(version: int) -> None:
        sync.push(version, "policy", "policy", out)
        served["engine"].update_weights_from_disk(out, version)

    serves_a_then_b(trainer, served, push, 41)


def test_released_weights_come_back_by_a_push_at_the_same_version(trainer, served):
    """A colocated step without an update (docs/weight-sync.md, "A step without an update"):
    the server released its weights (no host copy) and takes memory back without contents;
    the trainer hands its memory over and pushes the current weights again, at the version the
    server had, before the KV cache returns: it serves them."""
    from megatron_armor.trainer.weight_sync import ServerTarget, TensorRankSync

    engine, check = served["engine"], trainer["server"].check_serves
    sync = TensorRankSync(trainer["trainer"], bucket_mb=1)
    target = [ServerTarget(engine.servers[0].url, 1, 0)]
    push = in_session(served, lambda v: sync.push(v, "policy", "policy", target))
    try:
        push(51)
        engine.set_weight_version(51)
        check(served, trainer["b"], 51)
        engine.release_memory()  # weights and KV cache, named (never the CUDA graphs)
        trainer["trainer"].hand_over_memory()
        engine.resume_memory(["weights"])
        push(51)
        engine.resume_memory(["kv_cache"])
        check(served, trainer["b"], 51)
    finally:
        sync.close()
