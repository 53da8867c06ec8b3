"""The embedded engine next to the real SGLang server on CPU, and weight-sync seconds per transport
through that server (run it with the sglang tier's virtualenv: ``scripts/sglang_env.sh``).

Generation: the same batch (``--prompts`` tiny-task prompts x ``--n`` samples,
``--max-new-tokens``, temperature 1) through ``TorchEngine`` (in this process) and through one
CPU ``SGLangEngine`` server (``launch.CPU_SERVER_ARGS``, as ``orchestration.layout: cpu``
starts it), alternating A/B/A/B... for ``--rounds`` rounds after a warm-up of each; generated
tokens per second of each round and the ratio of the medians. The engine takes the process's
torch threads (``--threads``); the server its own (it binds OpenMP to the host's cores).

Weight sync: the tiny model's weights into the server by each transport the project sends
(``disk``: an HF dir + ``/update_weights_from_disk``; ``distributed``: gloo broadcasts in
buckets inside a weight-update session; ``tensor``: the inline CPU payload inside a session),
``--reps`` pushes each after a warm-up, the median seconds per push and MB/s.

On a quiet machine: a second process on the same cores (an SGLang scheduler polling one, a test
run) skews both sides. Figures are per machine.

    PYTHONPATH=$PWD ~/.cache/megatron_armor/sglang-venv/bin/python \\
        benchmarks/bench_sglang_cpu.py [--rounds 6] [--prompts 16] [--n 4] [--max-new-tokens 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "sglang_tier"), str(REPO / "tests" / "e2e")]

from process_group import free_ports  # noqa: E402
from sglang_servers import cpu_servers  # noqa: E402

from megatron_armor.rollout.protocol import SamplingParams  # noqa: E402
from megatron_armor.rollout.sglang import weights as transport  # noqa: E402
from megatron_armor.rollout.sglang.client import (  # noqa: E402
    ClientSettings,
    update_weights_from_tensor_payload,
)
from megatron_armor.rollout.sglang.distributed import DistributedWeightSender  # noqa: E402
from megatron_armor.rollout.torch_engine import TorchEngine  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default=str(REPO / "artifacts" / "tiny"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def tiny_prompts(tiny: Path, count: int) -> list[list[int]]:
    import pyarrow.parquet as pq

    from megatron_armor.tiny.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny / "model"))
    rows = pq.read_table(tiny / "data" / "val.parquet").to_pylist()[:count]
    return [tokenizer.encode(r["prompt"][0]["content"]) for r in rows]


def tokens_per_second(engine, prompts, n: int, params: SamplingParams) -> float:
    start = time.perf_counter()
    out = engine.generate(prompts, n, params)
    seconds = time.perf_counter() - start
    return sum(len(s.token_ids) for g in out for s in g) / seconds


def bench_generation(args, engine, embedded, prompts) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    for side in (embedded, engine):  # warm-up
        tokens_per_second(side, prompts, args.n, params)
    rates = {"embedded": [], "sglang": []}
    for _ in range(args.rounds):
        rates["embedded"].append(tokens_per_second(embedded, prompts, args.n, params))
        rates["sglang"].append(tokens_per_second(engine, prompts, args.n, params))
    print(f"generation: {len(prompts)} prompts x {args.n} samples, <= {args.max_new_tokens} "
          f"new tokens, {args.rounds} alternating rounds (tokens/s)")  # fmt: skip
    for name, values in rates.items():
        print(f"  {name:9s} median {statistics.median(values):8.0f}  "
              f"min {min(values):8.0f}  max {max(values):8.0f}")  # fmt: skip
    ratio = statistics.median(rates["sglang"]) / statistics.median(rates["embedded"])
    print(f"  sglang / embedded: {ratio:.2f}")


def push_disk(engine, tensors, version):
    engine.update_weights(tensors, version)


def push_distributed(engine, tensors, version, sender):
    engine.begin_weight_update()
    try:
        sender.send(tensors, version, timeout_s=300)
    finally:
        engine.end_weight_update()
    engine.set_weight_version(version)


def push_tensor(engine, tensors, version, bucket_bytes):
    server = engine.servers[0]
    engine.begin_weight_update()
    try:
        for bucket in transport.iter_buckets(tensors, bucket_bytes):
            serialized = transport.serialize_bucket(bucket)
            body = update_weights_from_tensor_payload([serialized.text], version, None)
            post(server.url + transport.TENSOR_ENDPOINT, body, engine.api_key)
    finally:
        engine.end_weight_update()
    engine.set_weight_version(version)


def post(url: str, body: dict, key: str) -> None:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def bench_weight_sync(args, engine, tensors) -> None:
    mb = sum(t.numel() * t.element_size() for _, t in tensors) / 1e6
    server = engine.servers[0]
    sender = DistributedWeightSender(
        [(server.url, server.tp)], "127.0.0.1", free_ports(1)[0], "armor-bench-pp0",
        bucket_bytes=args.bucket_mb << 20, backend="gloo",
        settings=ClientSettings(api_key=engine.api_key),
    )  # fmt: skip
    sender.connect(timeout_s=300)
    pushes = {
        "disk": lambda v: push_disk(engine, tensors, v),
        "distributed": lambda v: push_distributed(engine, tensors, v, sender),
        "tensor": lambda v: push_tensor(engine, tensors, v, args.bucket_mb << 20),
    }
    print(f"weight sync: {mb:.2f} MB of weights, {args.bucket_mb} MB buckets, "
          f"median of {args.reps} pushes after a warm-up")  # fmt: skip
    version = 100
    try:
        for name, push in pushes.items():
            push(version)
            times = []
            for _ in range(args.reps):
                version += 1
                start = time.perf_counter()
                push(version)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            print(f"  {name:12s} {median:7.3f} s per push  ({mb / median:7.1f} MB/s)")
    finally:
        sender.close()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tiny = Path(args.tiny)
    prompts = tiny_prompts(tiny, args.prompts)
    embedded = TorchEngine(str(tiny / "model"), max_batch=args.prompts * args.n)
    tensors = embedded.state_tensors()
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        with cpu_servers(tiny / "model", Path(tmp)) as engine:
            bench_generation(args, engine, embedded, prompts)
            bench_weight_sync(args, engine, tensors)


if __name__ == "__main__":
    main()
