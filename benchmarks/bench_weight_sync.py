"""Weight-sync bandwidth per transport: the object-store path vs the trainer-owned paths.

One model-sized set of HF-named tensors (``--mb`` MB of bf16 in ``--tensors`` tensors) goes
from this process (the trainer rank) to a receiving process (the server) by:

- ``object_store``: ``ray.put`` of the CPU copies as a ``types.NamedTensorList`` (numpy
  buffers) and ``ray.get`` in a Ray actor (the embedded engine's path); ``object_store_torch``
  the same with torch's own pickling (what it did before, and what every transport did before
  the weight sync moved to the ranks);
- ``disk``: ``DiskRankSync``'s layout (bucketed safetensors shards) written here and read back
  by the receiver;
- ``distributed``: ``DistributedWeightSender``'s bucketed broadcasts (gloo on CPU, NCCL when
  ``--device cuda``) into a receiver in the same process group;
- ``tensor`` (``--device cuda`` with SGLang installed): a bucket serialized as SGLang's
  ``FlattenedTensorBucket`` CUDA-IPC handle and rebuilt in the receiver.

Each line is the median of ``--reps`` runs after a warm-up, in GB/s of weight bytes delivered.

    python benchmarks/bench_weight_sync.py [--mb 256] [--bucket-mb 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="weight bytes to move (MB)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def make_weights(mb: int, count: int, device: str) -> list[tuple[str, torch.Tensor]]:
    numel = (mb << 20) // 2 // count
    return [(f"model.layers.{i}.w", torch.randn(numel, device=device).to(torch.bfloat16))
            for i in range(count)]  # fmt: skip


def total_bytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def object_store(named, reps: int, wire: bool = True) -> float:
    import ray

    from megatron_armor.types import NamedTensorList

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Receiver:
        def load(self, tensors) -> int:
            return total_bytes(tensors)

    receiver = Receiver.remote()
    cpu = [(n, t.cpu()) for n, t in named]
    cpu = NamedTensorList(cpu) if wire else cpu
    try:
        return median_seconds(lambda: ray.get(receiver.load.remote(ray.put(cpu))), reps)
    finally:
        ray.shutdown()


def disk(named, bucket_mb: int, reps: int) -> float:
    from safetensors.torch import load_file, save_file

    from megatron_armor.rollout.sglang.weights import iter_buckets
    from megatron_armor.trainer.weight_sync import shard_name

    def push():
        with tempfile.TemporaryDirectory() as out:
            cpu = ((n, t.cpu()) for n, t in named)
            for index, bucket in enumerate(iter_buckets(cpu, bucket_mb << 20)):
                save_file(dict(bucket), os.path.join(out, shard_name(0, index)))
            for file in sorted(os.listdir(out)):  # what the server reads back
                load_file(os.path.join(out, file))

    return median_seconds(push, reps)


def _receive(port: int, backend: str, device: str, meta, reps: int) -> None:
    from megatron_armor.rollout.sglang.weights import new_weight_sync_group

    group = new_weight_sync_group("127.0.0.1", port, 1, 2, "bench", backend)
    for _ in range(reps + 1):
        for shape, dtype in meta:
            torch.distributed.broadcast(torch.empty(shape, dtype=dtype, device=device), 0, group)
        torch.distributed.barrier(group)


def distributed(named, bucket_mb: int, reps: int, device: str) -> float:
    from megatron_armor.net import free_port
    from megatron_armor.rollout.sglang.weights import (
        broadcast_bucket,
        iter_buckets,
        new_weight_sync_group,
    )

    backend, port = ("nccl" if device == "cuda" else "gloo"), free_port()
    meta = [(tuple(t.shape), t.dtype) for _, t in named]
    receiver = mp.get_context("spawn").Process(
        target=_receive, args=(port, backend, device, meta, reps)
    )
    receiver.start()
    group = new_weight_sync_group("127.0.0.1", port, 0, 2, "bench", backend)

    def push():
        for bucket in iter_buckets(named, bucket_mb << 20):
            broadcast_bucket(bucket, group)
        torch.distributed.barrier(group)

    try:
        return median_seconds(push, reps)
    finally:
        receiver.join(timeout=60)


def _rebuild(queue, serialized: list[str]) -> None:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()
    loaded = 0
    for blob in serialized:
        data = MultiprocessingSerializer.deserialize(blob)
        bucket = FlattenedTensorBucket(
            flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
        )
        loaded += sum(t.numel() * t.element_size() for _, t in bucket.reconstruct_tensors())
    torch.cuda.synchronize()
    queue.put(loaded)


def tensor(named, bucket_mb: int, reps: int) -> float:
    from megatron_armor.rollout.sglang.weights import iter_buckets, serialize_bucket

    ctx = mp.get_context("spawn")

    def push():
        kept = [serialize_bucket(b) for b in iter_buckets(named, bucket_mb << 20)]
        queue = ctx.Queue()
        proc = ctx.Process(target=_rebuild, args=(queue, [k.text for k in kept]))
        proc.start()
        assert queue.get(timeout=300) == total_bytes(named)
        proc.join()

    return median_seconds(push, reps)


def main() -> None:
    args = parse_args()
    named = make_weights(args.mb, args.tensors, args.device)
    gb = total_bytes(named) / 1e9
    runs = {
        "object_store": lambda: object_store(named, args.reps),
        "object_store_torch": lambda: object_store(named, args.reps, wire=False),
        "disk": lambda: disk(named, args.bucket_mb, args.reps),
        "distributed": lambda: distributed(named, args.bucket_mb, args.reps, args.device),
    }
    if args.device == "cuda":
        runs["tensor"] = lambda: tensor(named, args.bucket_mb, args.reps)
    print(f"{gb:.3f} GB of bf16 weights in {args.tensors} tensors, buckets of {args.bucket_mb} MB, "
          f"device {args.device}")  # fmt: skip
    for name, run in runs.items():
        seconds = run()
        print(f"{name:>18}: {gb / seconds:7.3f} GB/s  ({seconds:.3f} s per sync)", flush=True)
    if args.device != "cuda":
        print(f"{'tensor':>18}: n/a (CUDA IPC needs --device cuda and SGLang)")


if __name__ == "__main__":
    main()
