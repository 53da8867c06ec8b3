"""Real SGLang servers on CPU for the sglang tier, started the way the rollout workers start
them (``SGLangEngine`` with ``on_cpu``: ``launch.CPU_SERVER_ARGS``), and the oracles they are
compared with (transformers' fp32 forward of the same weights)."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from pathlib import Path

import torch
from process_group import free_ports  # tests/e2e (on the path: conftest.py)

from megatron_armor.config.schema import SGLangConfig
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.sglang.client import ClientSettings, update_weights_from_tensor_payload
from megatron_armor.rollout.sglang.distributed import DistributedWeightSender
from megatron_armor.rollout.sglang.engine import SGLangEngine
from megatron_armor.rollout.torch_engine import TorchEngine

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
TEMPERATURE = 0.8  # != 1 so the log-prob convention (log_softmax(logits / T)) is checked
STARTUP_S = 420.0  # a server starts in 25-50 s on a quiet 2-core machine; CI is not quiet
# CPU servers run fp32 (launch.CPU_SERVER_ARGS) like the oracles: what separates them is the
# order of floating-point sums (SGLang's torch-native attention vs transformers' SDPA)
MEAN_TOL, MAX_TOL = 1e-4, 1e-3


@contextlib.contextmanager
def cpu_servers(model_dir, log_dir: Path, *, num_engines: int = 1, router: bool = False,
                overrides: dict | None = None, transport: str = "disk", **sglang):  # fmt: skip
    """An ``SGLangEngine`` of ``num_engines`` CPU servers (and a router), launched, then closed."""
    base, router_port = free_ports(2)
    cfg = SGLangConfig(num_engines=num_engines, base_port=base, router=router,
                       router_port=router_port, startup_timeout_s=STARTUP_S,
                       weight_transport=transport, **sglang)  # fmt: skip
    engine = SGLangEngine(str(model_dir), cfg, weights_dir=str(log_dir / "weights"),
                          model_overrides=overrides, on_cpu=True)  # fmt: skip
    try:
        engine.launch(colocated=False, log_dir=str(log_dir))
        yield engine
    finally:
        engine.close()


def oracle(model_dir, tensors=None, overrides: dict | None = None) -> TorchEngine:
    """transformers' fp32 forward of ``model_dir`` (with ``tensors`` loaded, and the overrides
    set as SGLang sets them): the log-probs a server holding those weights must return."""
    engine = TorchEngine(str(model_dir), model_overrides=overrides)
    if tensors is not None:
        engine.update_weights(tensors, version=1)
    return engine


def logprob_gap(reference: TorchEngine, prompts, outputs) -> tuple[float, float]:
    """Mean and max ``|server - reference|`` over every generated token."""
    diffs = []
    for prompt, group in zip(prompts, outputs, strict=True):
        for out in group:
            ref = reference.teacher_forced_logprobs(prompt, out.token_ids, TEMPERATURE)
            diffs += [abs(a - b) for a, b in zip(ref, out.logprobs, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def sample(engine, n: int = 2, max_new_tokens: int = 16):
    return engine.generate(
        PROMPTS, n, SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new_tokens)
    )


def perturbed(tensors, seed: int, scale: float = 0.5):
    """The same named tensors with noise of ``scale`` times each tensor's std added: weights
    whose log-probs differ from the originals' by far more than :data:`MAX_TOL`."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, t in tensors:
        noise = torch.randn(t.shape, generator=gen, dtype=t.dtype) * (t.float().std() * scale)
        out.append((name, (t + noise).contiguous()))
    return out


def push_distributed(engine, tensors, version: int, group: str, bucket_bytes: int) -> int:
    """``tensors`` broadcast over gloo from this process (rank 0) into the engine's first
    server, in buckets, inside the update session; the bytes sent."""
    server = engine.servers[0]
    sender = DistributedWeightSender(
        [(server.url, server.tp)], "127.0.0.1", free_ports(1)[0], group,
        bucket_bytes=bucket_bytes, backend="gloo", settings=ClientSettings(api_key=engine.api_key),
    )  # fmt: skip
    try:
        sender.connect(timeout_s=300)
        engine.begin_weight_update()
        try:
            sent = sender.send(tensors, version=version, timeout_s=300)
        finally:
            engine.end_weight_update()
    finally:
        sender.close()
    engine.set_weight_version(version)
    return sent


def push_tensor_inline(engine, tensors, version: int, bucket_bytes: int) -> int:
    """The CPU form of ``/update_weights_from_tensor`` (``weights.serialize_bucket`` on a rank
    without a GPU: the bucket's named tensors inline), one request per bucket, inside the
    update session; the number of buckets."""
    buckets = list(transport.iter_buckets(tensors, bucket_bytes))
    engine.begin_weight_update()
    try:
        for bucket in buckets:
            serialized = transport.serialize_bucket(bucket)
            assert serialized.load_format is None  # the CPU form
            body = update_weights_from_tensor_payload([serialized.text], version, None)
            request = urllib.request.Request(
                engine.servers[0].url + transport.TENSOR_ENDPOINT, data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json",
                         "Authorization": f"Bearer {engine.api_key}"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=300) as response:
                assert response.status == 200
    finally:
        engine.end_weight_update()
    engine.set_weight_version(version)
    return len(buckets)
