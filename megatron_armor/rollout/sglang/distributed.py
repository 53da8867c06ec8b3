"""NCCL weight streaming from a trainer rank into SGLang servers (disaggregated mode).

Runs on the trainer rank that is tensor-parallel rank 0 and data-parallel rank 0 of a
pipeline stage (the ranks whose ``export_weights`` yields tensors). Each stage owns one
group named ``{group_prefix}-pp{stage}``: the trainer rank is rank 0, engine ``i``'s TP
ranks are ``1 + sum(tp of engines before i) ...``. Per bucket, the metadata POST
(``/update_weights_from_distributed``) and the broadcast run at the same time: SGLang
allocates the receive buffers from the metadata and joins the broadcasts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.sglang.client import (
    ClientSettings,
    EventLoopThread,
    SGLangClient,
    destroy_weights_update_group_payload,
    init_weights_update_group_payload,
    update_weights_from_distributed_payload,
)


class DistributedWeightSender:
    """Trainer-side end of ``update_weights_from_distributed`` for one pipeline stage.

    ``targets`` is ``[(server_url, tp_size), ...]`` (``SGLangEngine.servers``).
    """

    def __init__(
        self,
        targets: list[tuple[str, int]],
        master_address: str,
        master_port: int,
        group_name: str,
        bucket_bytes: int = 512 << 20,
        backend: str = "nccl",
        settings: ClientSettings | None = None,
    ) -> None:
        self.targets = targets
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.group = None
        self._loop = EventLoopThread()
        self._client = SGLangClient(settings)
        self._loop.run(self._client.__aenter__())

    @property
    def world_size(self) -> int:
        return 1 + sum(tp for _, tp in self.targets)

    def rank_offsets(self) -> list[int]:
        """First group rank of each target engine (the sender is rank 0)."""
        return [1 + c for c in itertools.accumulate([0] + [tp for _, tp in self.targets[:-1]])]

    def connect(self, timeout_s: float = 600.0) -> None:
        """Create the group: every server joins via ``/init_weights_update_group`` while this
        rank joins as rank 0 (both block in the same rendezvous)."""
        pending = [
            self._loop.submit(
                self._client.post(url, "/init_weights_update_group", self._init_payload(offset))
            )
            for (url, _), offset in zip(self.targets, self.rank_offsets(), strict=True)
        ]
        self.group = transport.new_weight_sync_group(
            self.master_address,
            self.master_port,
            0,
            self.world_size,
            self.group_name,
            self.backend,
            timeout_s,
        )
        for future in pending:
            future.result(timeout=timeout_s)

    def _init_payload(self, offset: int) -> dict:
        return init_weights_update_group_payload(
            self.master_address,
            self.master_port,
            offset,
            self.world_size,
            self.group_name,
            self.backend,
        )

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        timeout_s: float = 600.0,
    ) -> int:
        """Stream ``named_tensors`` bucket by bucket; returns the bytes sent."""
        if self.group is None:
            raise RuntimeError("DistributedWeightSender.send before connect()")
        sent = 0
        for bucket in transport.iter_buckets(named_tensors, self.bucket_bytes):
            payload = update_weights_from_distributed_payload(
                **transport.bucket_metadata(bucket), version=version, group_name=self.group_name
            )
            pending = [
                self._loop.submit(
                    self._client.post(url, "/update_weights_from_distributed", payload)
                )
                for url, _ in self.targets
            ]
            transport.broadcast_bucket(bucket, self.group)
            for future in pending:
                future.result(timeout=timeout_s)
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
        return sent

    def close(self) -> None:
        """``/destroy_weights_update_group`` on the servers, destroy the local group."""
        import torch.distributed as dist

        if self.group is not None:
            body = destroy_weights_update_group_payload(self.group_name)
            pending = [
                self._loop.submit(self._client.post(url, "/destroy_weights_update_group", body))
                for url, _ in self.targets
            ]
            dist.destroy_process_group(self.group)
            for future in pending:
                try:
                    future.result(timeout=60)
                except Exception:  # noqa: BLE001 - best effort: a server may already be gone
                    pass
            self.group = None
        self._loop.run(self._client.__aexit__(None, None, None))
        self._loop.close()
