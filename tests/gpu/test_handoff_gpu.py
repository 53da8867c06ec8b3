"""The colocated memory hand-off on a GPU (gpu tier): ``trainer.offload.return_cached_blocks``
gives the caching allocator's free blocks back to CUDA, so that another process on the GPU can
take them (as a colocated engine resuming its memory does, docs/weight-sync.md)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
GiB = 1024**3


def take(queue, num_bytes: int) -> None:
    try:
        torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(1)
        torch.cuda.synchronize()
        queue.put("ok")
    except Exception as err:  # the parent asserts on it
        queue.put(f"{type(err).__name__}: {err}")


def test_returned_blocks_are_free_for_another_process():
    from megatron_armor.trainer.offload import return_cached_blocks

    free, _ = torch.cuda.mem_get_info()
    size = int(free * 0.6)  # an activation peak: more than half of what is free
    peak = torch.empty(size, dtype=torch.uint8, device="cuda")
    del peak  # freed, but still reserved by this process's caching allocator
    assert torch.cuda.memory_reserved() >= size
    return_cached_blocks()
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < GiB
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=take, args=(queue, size))
    child.start()
    assert queue.get(timeout=120) == "ok"
    child.join(timeout=60)
