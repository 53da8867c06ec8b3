"""Weight transports into SGLang servers (docs/weight-sync.md).

HF-named full tensors are cut into buckets of about ``rollout.sglang.weight_bucket_mb`` and
sent by one of:

- ``tensor`` (colocated; ``POST /update_weights_from_tensor``): each bucket is packed into a
  ``FlattenedTensorBucket`` (one buffer + metadata) on a trainer GPU and serialized with
  SGLang's ``MultiprocessingSerializer`` (a CUDA IPC handle; device ids replaced by GPU UUIDs
  by SGLang's ``monkey_patch_torch_reductions``). ``serialized_named_tensors`` holds one entry
  per TP rank of the server, entry ``t`` made on the GPU of TP rank ``t`` (SGLang's
  ``TpModelWorker`` deserializes ``serialized_named_tensors[tp_rank]``),
  ``load_format='flattened_bucket'``. CPU tensors cannot take this path: their pickled
  file-descriptor handshake only works with a multiprocessing child, which the SGLang
  scheduler is not.
- ``distributed`` (disaggregated; ``POST /init_weights_update_group`` once, then per bucket
  ``POST /update_weights_from_distributed`` with ``names``/``dtypes``/``shapes`` while the
  sender broadcasts each tensor from rank 0 of a dedicated NCCL group). One group per
  pipeline stage: the stage's TP-rank-0 / DP-rank-0 trainer rank is its rank 0, so every
  stage streams its own layers in parallel.
- ``disk`` (``POST /update_weights_from_disk`` with ``model_path``): the trainer ranks saved an
  HF dir (safetensors shards and their index).

The request bodies are built by the pure ``*_payload`` functions of ``client.py`` (checked
against SGLang's request dataclasses); the senders live with the trainer ranks
(``trainer/weight_sync.py``).

Every request carries ``weight_version`` (a string in SGLang) so generation results name it.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]
TENSOR_ENDPOINT = "/update_weights_from_tensor"
DISTRIBUTED_ENDPOINT = "/update_weights_from_distributed"
DISK_ENDPOINT = "/update_weights_from_disk"
BEGIN_ENDPOINT = "/begin_weight_update"
END_ENDPOINT = "/end_weight_update"
FLUSH_ENDPOINT = "/flush_cache"


def iter_buckets(
    named_tensors: NamedTensors, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive tensors into lists of at most ``bucket_bytes`` (a larger tensor is
    a bucket of its own). Order is preserved."""
    if bucket_bytes <= 0:
        raise ValueError(f"rollout.sglang.weight_bucket_mb must be > 0, got {bucket_bytes} bytes")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'`` (SGLang does ``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


def bucket_metadata(bucket: list[tuple[str, torch.Tensor]]) -> dict:
    """``names``/``dtypes``/``shapes`` of ``bucket`` for ``/update_weights_from_distributed``."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


def require_cuda_tensors(bucket: list[tuple[str, torch.Tensor]]) -> None:
    """The tensor transport hands CUDA IPC handles to the server. A CPU tensor would be
    pickled as a file descriptor shared through this process's ``resource_sharer``, which an
    independent server process cannot authenticate against, so it is refused here."""
    on_cpu = [name for name, tensor in bucket if not tensor.is_cuda]
    if on_cpu:
        raise ValueError(
            f"rollout.sglang.weight_transport=tensor got CPU tensors ({on_cpu[:3]}...): it "
            "sends CUDA IPC handles, which need the weights on a GPU of the server's node; "
            "use weight_transport=distributed or disk without a colocated GPU"
        )


def _sglang_serialization():
    """SGLang's ``MultiprocessingSerializer``, ``FlattenedTensorBucket`` and
    ``monkey_patch_torch_reductions`` (``sglang.srt.utils`` / ``weight_sync``, sglang 0.5.x)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as err:
        raise RuntimeError(
            "rollout.sglang.weight_transport=tensor needs the sglang package (GPU clusters); "
            "install requirements-gpu.txt or use weight_transport=disk"
        ) from err
    return MultiprocessingSerializer, FlattenedTensorBucket, monkey_patch_torch_reductions


@dataclass
class SerializedBucket:
    """One bucket as ``/update_weights_from_tensor`` takes it: ``text`` for
    ``serialized_named_tensors``, its ``load_format``, and what must stay alive until every
    server has loaded it (the CUDA buffer the IPC handle points at)."""

    text: str
    load_format: str | None
    keepalive: Any = None


def serialize_bucket(bucket: list[tuple[str, torch.Tensor]]) -> SerializedBucket:
    """``bucket`` for ``/update_weights_from_tensor``: on a rank with a GPU,
    :func:`serialize_cuda_bucket`; on one without, :func:`serialize_cpu_bucket`."""
    if torch.cuda.is_available():
        return serialize_cuda_bucket(bucket)
    return serialize_cpu_bucket(bucket)


def serialize_cuda_bucket(bucket: list[tuple[str, torch.Tensor]]) -> SerializedBucket:
    """Pack ``bucket`` (CUDA tensors of one GPU) into a ``FlattenedTensorBucket`` and serialize
    it (a CUDA IPC handle, device named by UUID as SGLang's receiver expects); the flat buffer
    is kept alive by the caller until the servers have loaded it."""
    require_cuda_tensors(bucket)
    serializer, bucket_cls, patch_reductions = _sglang_serialization()
    patch_reductions()
    flat = bucket_cls(named_tensors=bucket)
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    text = serializer.serialize(data, output_str=True)
    return SerializedBucket(text, "flattened_bucket", data["flattened_tensor"])


def serialize_cpu_bucket(bucket: list[tuple[str, torch.Tensor]]) -> SerializedBucket:
    """``bucket``'s named CPU tensors with their bytes inline: plain ``pickle`` (a tensor's
    storage pickles as its bytes, ``torch.storage._load_from_bytes``, which SGLang's
    ``SafeUnpickler`` reads with its restricted ``torch.load``), base64 as SGLang's
    ``MultiprocessingSerializer.deserialize`` decodes it, ``load_format=None`` (named tensors).
    ``MultiprocessingSerializer`` itself would share a CPU tensor as a file descriptor through
    this process's ``resource_sharer``, which a server process (not our child) cannot open.
    For trainer ranks without a GPU: the whole bucket travels in the HTTP body."""
    on_gpu = [name for name, tensor in bucket if tensor.is_cuda]
    if on_gpu:
        raise ValueError(f"serialize_cpu_bucket got CUDA tensors ({on_gpu[:3]}...)")
    named = [(name, tensor.detach().contiguous().clone()) for name, tensor in bucket]
    text = base64.b64encode(pickle.dumps(named, protocol=pickle.HIGHEST_PROTOCOL)).decode()
    return SerializedBucket(text, None)


def new_weight_sync_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout_s: float = 600.0,
) -> Any:
    """A process group outside the default one (the trainer's world stays untouched).

    Same construction as SGLang's ``init_custom_process_group`` (the engine side of
    ``init_weights_update_group``): TCP rendezvous at ``master_address:master_port``, a
    prefix store named ``group_name``, and ``_new_process_group_helper``.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix_store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        prefix_store,
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_bucket(bucket: list[tuple[str, torch.Tensor]], group: Any) -> None:
    """Broadcast each tensor of ``bucket`` from rank 0 of ``group``, in order (the receivers
    allocate ``names/dtypes/shapes`` from the matching ``/update_weights_from_distributed``)."""
    import torch.distributed as dist

    tensors = [t.contiguous() for _, t in bucket]  # kept alive until every broadcast is done
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()
