"""The trainer ranks' end of the weight sync into SGLang servers, one class per transport.

The driver (``orchestration/actors/weight_sync.py``) picks the transport once from
``rollout.sglang.weight_transport`` and asks every trainer rank to :meth:`RankSync.push`; the
weights go from the trainer's GPUs to the servers without passing the driver or Ray's object
store (docs/weight-sync.md):

- :class:`TensorRankSync` (``tensor``, colocated): every rank holds every full HF tensor of
  a bucket on its own GPU (TP-gathered; with PP each stage broadcasts its own layers over the
  PP group), serializes a CUDA-IPC handle of it with SGLang's ``MultiprocessingSerializer``,
  and the ranks on one server's GPUs gather their handles to the rank on its first GPU, which
  posts ``/update_weights_from_tensor`` with one entry per server TP rank (TP rank ``t`` reads
  the copy on its own GPU).
- :class:`DistributedRankSync` (``distributed``): each PP stage's export rank broadcasts CUDA
  tensors, bucketed, into the servers over an NCCL group (``DistributedWeightSender``).
- :class:`DiskRankSync` (``disk``): each PP stage's export rank writes its layers as
  safetensors shards, in parallel; rank 0 writes the index and the config files.

Every :meth:`RankSync.push` is collective over the trainer world: all ranks call it, with the
same arguments, in the same order. With colocated servers (``tensor`` always, ``disk`` under
``orchestration.layout: colocated``) a push ends by giving its buffers back to CUDA (the
gathered tensors and the flattened buckets, ~2 buckets per rank: ``offload.return_cached_blocks``),
so the servers' KV cache, resumed after the push, finds that memory free (docs/weight-sync.md).
"""

from __future__ import annotations

import itertools
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_armor.rollout.backends import backend_of
from megatron_armor.rollout.hf_dir import CONFIG_FILES
from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.sglang.client import update_weights_from_tensor_payload
from megatron_armor.trainer.offload import return_cached_blocks

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ServerTarget:
    """One SGLang server a push goes to."""

    url: str
    tp: int
    first_rank: int = 0
    """Trainer rank on the server's first GPU (colocated: rollout GPU ``g`` is rank ``g``)."""
    api_key: str = field(default="", repr=False)
    """The server's ``--api-key`` (sent as ``Authorization: Bearer``; ``""``: none)."""


def bucket_bytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def stage_broadcast(buckets: Iterator[Bucket] | None, src: int, device) -> Iterator[Bucket]:
    """The buckets of the stage whose PP-group rank is ``src``, on every rank of the PP group.

    ``buckets`` is the source stage's own iterator (``None`` elsewhere). Per bucket the source
    broadcasts ``[(name, shape, dtype)]`` (``None`` ends the stage), then each tensor.
    """
    from megatron_armor.trainer import parallel

    group = parallel.pp_group()
    src_global = dist.get_global_rank(group, src)
    while True:
        bucket = next(buckets, None) if buckets is not None else None
        meta = [[(n, tuple(t.shape), t.dtype) for n, t in bucket] if bucket else None]
        dist.broadcast_object_list(meta, src=src_global, group=group)
        if meta[0] is None:
            return
        if bucket is None:
            bucket = [(n, torch.empty(s, dtype=d, device=device)) for n, s, d in meta[0]]
        for _, tensor in bucket:
            dist.broadcast(tensor, src=src_global, group=group)
        yield bucket


def every_stage_buckets(trainer, weights: str, size: int) -> Iterator[Bucket]:
    """Buckets of every PP stage's full HF tensors, on every rank's own device, stage by stage
    (collective over the TP and PP groups)."""
    from megatron_armor.trainer import parallel

    def own() -> Iterator[Bucket]:
        named = trainer.export_weights(weights, device=None, every_rank=True)
        return transport.iter_buckets(named, size)

    if parallel.pp_size() == 1:
        yield from own()
        return
    device = parallel.collective_device()
    for stage in range(parallel.pp_size()):
        mine = own() if stage == parallel.pp_rank() else None
        yield from stage_broadcast(mine, stage, device)


class RankSync(ABC):
    """One trainer rank's end of a weight transport; ``colocated``: the servers share this
    rank's GPU, which gets the push's buffers back at its end."""

    transport = ""

    def __init__(
        self, trainer, bucket_mb: int, timeout_s: float = 600.0, colocated: bool = False
    ) -> None:
        self.trainer = trainer
        self.bucket_bytes = bucket_mb << 20
        self.timeout_s = timeout_s
        self.colocated = colocated

    def push(self, version: int, weights: str, pool: str, target) -> int:
        """Send ``weights`` (``policy`` | ``ref``) at ``version`` to ``pool``'s servers
        ``target`` (the transport's address of them); returns the bytes this rank sent.
        Colocated, the push's buffers (dropped by then) go back to CUDA before it returns."""
        sent = self._push(version, weights, pool, target)
        if self.colocated:
            return_cached_blocks()
        return sent

    @abstractmethod
    def _push(self, version: int, weights: str, pool: str, target) -> int:
        """:meth:`push` without the buffers' return; every buffer is dropped when it ends."""

    def drop(self, pool: str) -> None:  # noqa: B027 - most transports keep nothing per pool
        """Forget per-pool state (one of ``pool``'s servers restarted)."""

    def close(self) -> None:  # noqa: B027 - most transports hold nothing
        """Release what the transport holds."""


class TensorRankSync(RankSync):
    """``tensor``: CUDA-IPC handles into the colocated servers (module docstring)."""

    transport = "tensor"

    def __init__(self, trainer, bucket_mb: int, timeout_s: float = 600.0) -> None:
        super().__init__(trainer, bucket_mb, timeout_s, colocated=True)  # validate.py: only so
        self.groups: dict[tuple, object] = {}
        self._client = None

    def _push(self, version: int, weights: str, pool: str, target: list[ServerTarget]) -> int:
        """Every bucket of every stage into the servers ``target`` (inside their weight-update
        session, opened and closed by their rollout worker: ``orchestration/actors/weight_sync.py``).
        On ranks without a GPU each bucket travels as inline bytes
        (``weights.serialize_cpu_bucket``), the CPU form of the same requests."""
        rank, sent = dist.get_rank(), 0
        groups = [self._gather_group(t) for t in target]
        for bucket in every_stage_buckets(self.trainer, weights, self.bucket_bytes):
            serialized = transport.serialize_bucket(bucket)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the flat buffer is written before a server maps it
            for server, group in zip(target, groups, strict=True):
                if group is not None:
                    self._post(server, group, serialized, version, rank)
            if target and rank == target[0].first_rank:  # the model's bytes, counted once
                sent += bucket_bytes(bucket)
            dist.barrier()  # every server has loaded the bucket: its buffer may be freed
            del serialized, bucket
        return sent

    def _gather_group(self, server: ServerTarget):
        """The group of the ranks on ``server``'s GPUs (``None`` for the other ranks; made
        collectively, once per rank set)."""
        ranks = tuple(range(server.first_rank, server.first_rank + server.tp))
        if ranks not in self.groups:
            self.groups[ranks] = dist.new_group(list(ranks), backend="gloo")
        return self.groups[ranks] if dist.get_rank() in ranks else None

    def _post(self, server: ServerTarget, group, serialized, version: int, rank: int) -> None:
        """Gather the server's TP ranks' handles on its first rank, which posts them."""
        first = server.first_rank
        handles = [None] * server.tp if rank == first else None
        dist.gather_object(serialized.text, handles, dst=first, group=group)
        if rank == first:
            payload = update_weights_from_tensor_payload(handles, version, serialized.load_format)
            self._client_loop(server.api_key).run(
                self._client.post(server.url, transport.TENSOR_ENDPOINT, payload)
            )

    def _client_loop(self, api_key: str):
        """The client for servers answering ``api_key`` (a new one when the key changes)."""
        from megatron_armor.rollout.sglang.client import (
            ClientSettings,
            EventLoopThread,
            SGLangClient,
        )

        if self._client is not None and self._client.settings.api_key != api_key:
            self.close()
        if self._client is None:
            self._loop = EventLoopThread()
            settings = ClientSettings(control_timeout_s=self.timeout_s, api_key=api_key)
            self._client = SGLangClient(settings)
            self._loop.run(self._client.__aenter__())
        return self._loop

    def close(self) -> None:
        if self._client is not None:
            self._loop.run(self._client.__aexit__(None, None, None))
            self._loop.close()
            self._client = None


def stage_turns(pp_size: int) -> list[int]:
    """The order in which the pipeline stages stream into the servers: one stage at a time.
    A server runs its requests one by one and blocks in each broadcast until every member of
    that stage's group joins: two stages streaming at once may reach two servers in opposite
    orders, each server then waiting in a group the other has not joined (a deadlock with
    ``pp > 1`` and two or more servers)."""
    return list(range(pp_size))


class DistributedRankSync(RankSync):
    """``distributed``: each PP stage's export rank broadcasts into the servers over NCCL
    (gloo on a machine without GPUs), one group per stage and pool, kept between pushes; the
    stages take turns (:func:`stage_turns`), a barrier over every rank between two turns."""

    transport = "distributed"

    def __init__(self, trainer, bucket_mb: int, timeout_s: float = 600.0, address: str = ""):
        super().__init__(trainer, bucket_mb, timeout_s)
        self.address = address
        self.senders: dict = {}

    def _push(self, version: int, weights: str, pool: str, target: list[ServerTarget]) -> int:
        from megatron_armor.trainer import parallel

        sent = 0
        for stage in stage_turns(parallel.pp_size()):
            if stage == parallel.pp_rank():  # the stage's ranks export together (TP gathers)
                sent += self._push_stage(version, weights, pool, target)
            dist.barrier()  # the stage is in every server before the next one streams
        return sent

    def _push_stage(self, version: int, weights: str, pool: str, target: list[ServerTarget]):
        tensors = iter(self.trainer.export_weights(weights, device=None))
        first = next(tensors, None)
        if first is None:  # not an exporting rank: the export already ran to its end
            return 0
        key = target[0].api_key if target else ""  # one pool: one engine's key
        sender = self._sender(pool, [(t.url, t.tp) for t in target], key)
        return sender.send(itertools.chain([first], tensors), version, self.timeout_s)

    def _sender(self, pool: str, targets: list[tuple[str, int]], api_key: str = ""):
        """The connected sender of this rank's stage into ``pool`` (a new one if the servers
        changed)."""
        from megatron_armor.net import free_port, node_ip, weight_group_name
        from megatron_armor.rollout.sglang.client import ClientSettings
        from megatron_armor.rollout.sglang.distributed import DistributedWeightSender
        from megatron_armor.trainer import parallel

        current = self.senders.get(pool)
        if current is not None and current.targets != targets:
            self.drop(pool)
        if pool not in self.senders:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            sender = DistributedWeightSender(
                targets, self.address or node_ip(), free_port(),
                weight_group_name(parallel.pp_rank(), pool), self.bucket_bytes, backend,
                ClientSettings(control_timeout_s=self.timeout_s, api_key=api_key),
            )  # fmt: skip
            try:
                sender.connect(timeout_s=self.timeout_s)
            except BaseException:
                sender.close()
                raise
            self.senders[pool] = sender
        return self.senders[pool]

    def drop(self, pool: str) -> None:
        sender = self.senders.pop(pool, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        for pool in list(self.senders):
            self.drop(pool)


def shard_name(stage: int, index: int) -> str:
    """File of bucket ``index`` of PP stage ``stage`` in a pushed weights directory."""
    return f"model-pp{stage:02d}-{index:05d}.safetensors"


class DiskRankSync(RankSync):
    """``disk``: the export ranks write their stage's buckets as safetensors shards into the
    directory ``target`` (on the filesystem the servers read); rank 0 then writes
    ``model.safetensors.index.json`` and the model's config and tokenizer files."""

    transport = "disk"

    def __init__(self, trainer, bucket_mb: int, model_dir: str, colocated: bool = False) -> None:
        super().__init__(trainer, bucket_mb, colocated=colocated)
        self.model_dir = model_dir

    def _push(self, version: int, weights: str, pool: str, target: str) -> int:
        from safetensors.torch import save_file

        from megatron_armor.trainer import parallel

        os.makedirs(target, exist_ok=True)
        named = self.trainer.export_weights(weights, device="cpu")
        weight_map, written = {}, 0
        for index, bucket in enumerate(transport.iter_buckets(named, self.bucket_bytes)):
            file = shard_name(parallel.pp_rank(), index)
            save_file(dict(bucket), os.path.join(target, file), metadata={"format": "pt"})
            weight_map.update({name: file for name, _ in bucket})
            written += bucket_bytes(bucket)
        maps = [None] * dist.get_world_size()
        dist.all_gather_object(maps, weight_map)
        if dist.get_rank() == 0:
            self._write_index(target, {k: v for m in maps for k, v in m.items()})
        dist.barrier()
        return written

    def _write_index(self, target: str, weight_map: dict[str, str]) -> None:
        import shutil

        for name in CONFIG_FILES:
            src = os.path.join(self.model_dir, name)
            if os.path.exists(src):
                shutil.copy2(src, target)
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1)


def make_rank_sync(config, trainer) -> RankSync | None:
    """The rank side of ``rollout.sglang.weight_transport`` (``None``: the embedded engine,
    which takes the export through the worker)."""
    if not backend_of(config).serves_over_http:
        return None
    sg = config.rollout.sglang
    kind = sg.weight_transport
    if kind == "tensor":
        return TensorRankSync(trainer, sg.weight_bucket_mb, sg.startup_timeout_s)
    if kind == "distributed":
        return DistributedRankSync(trainer, sg.weight_bucket_mb, sg.startup_timeout_s)
    if kind == "disk":
        colocated = config.orchestration.layout == "colocated"
        return DiskRankSync(trainer, sg.weight_bucket_mb, config.trainer.model_path, colocated)
    raise ValueError(
        f"rollout.sglang.weight_transport={kind!r} is not one of tensor|distributed|disk"
    )
