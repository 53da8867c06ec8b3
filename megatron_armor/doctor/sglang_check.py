"""The SGLang check of ``armor doctor``: a real ``sglang.launch_server`` on a tiny model, one
weight update through the configured ``rollout.sglang.weight_transport`` (new random weights,
version 1), one generation, and its log-probs against the trainer's.

The server runs bf16 kernels and the trainer fp32, so per-token log-probs agree to
:data:`MEAN_TOLERANCE` on average and :data:`MAX_TOLERANCE` at worst (a CPU server runs fp32:
``launch.CPU_SERVER_ARGS``; the distributed transport then streams over gloo). The new weights have a
sharpened output layer (log-probs spread over several nats), so a generation still under the
old weights would be off by whole nats; its ``weight_version`` would not be ``1`` either.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import torch

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.doctor import node, probes
from megatron_armor.doctor.report import CheckFailed, NotApplicable
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang import client, launch
from megatron_armor.rollout.sglang import weights as transport

MEAN_TOLERANCE, MAX_TOLERANCE = 0.05, 0.5
SAMPLES = 4
STARTUP_TIMEOUT_S = 300


def sglang_round_trip(config: ArmorConfig) -> str:
    if config.rollout.backend != "sglang":
        raise NotApplicable(f"rollout.backend={config.rollout.backend}: this config runs no SGLang")
    on_cpu = not torch.cuda.is_available()
    if importlib.util.find_spec("sglang") is None:
        if on_cpu:
            raise NotApplicable(f"{node.NO_CUDA}; sglang is not installed here")
        raise CheckFailed("sglang is not installed", "pip install -r requirements-gpu.txt")
    kind = config.rollout.sglang.weight_transport
    with tempfile.TemporaryDirectory(prefix="armor-doctor-sglang-") as tmp:
        first = probes.build_tiny_model(str(Path(tmp) / "v0"), seed=0)
        second = probes.build_tiny_model(str(Path(tmp) / "v1"), seed=1, logit_scale=25.0)
        gpu = 0 if on_cpu else server_gpu(kind)
        server, url = start_server(first, kind, Path(tmp) / "server.log", gpu, on_cpu)
        try:
            push_weights(url, kind, second, "cpu" if on_cpu else "cuda")
            samples, server_lp, versions = generate(url)
        finally:
            server.stop()
        trainer_lp = trainer_logprobs(config, second, samples)
    if set(versions) != {1}:
        raise CheckFailed(f"generations report weight versions {versions}, not 1",
                          f"the {kind} weight update did not reach the server; see its log")  # fmt: skip
    gaps = [abs(a - b) for a, b in zip(server_lp, trainer_lp, strict=True)]
    mean, worst = sum(gaps) / len(gaps), max(gaps)
    if not (mean < MEAN_TOLERANCE and worst < MAX_TOLERANCE):
        raise CheckFailed(
            f"server and trainer log-probs differ by {mean:.3f} nats on average, {worst:.3f} at most",
            "check SGLANG_RETURN_ORIGINAL_LOGPROB=false and the HF<->Megatron weight mapping",
        )
    where = " (CPU server)" if on_cpu else ""
    return (
        f"transport {kind}{where}: {len(gaps)} tokens, |server - trainer| log-prob mean "
        f"{mean:.3f}, max {worst:.3f} nats"
    )


def server_gpu(kind: str) -> int:
    """The server's GPU: the trainer's (0) when colocated; another one for ``distributed``,
    whose NCCL group cannot hold two ranks on one device."""
    if kind != "distributed":
        return 0
    if torch.cuda.device_count() < 2:
        raise NotApplicable(
            "weight_transport=distributed streams between GPUs (trainer and servers on "
            "different devices); this node has one"
        )
    return 1


def start_server(
    model_dir: str, kind: str, log: Path, gpu: int, on_cpu: bool = False
) -> tuple[launch.ManagedProcess, str]:
    """One server as the rollout workers start it (``launch.server_args_for``; without a GPU
    its CPU form, which SGLang 0.5.23 runs only with the sglang test tier's guards)."""
    port = node.free_port()
    dtype = "float32" if on_cpu else "bfloat16"
    args = launch.server_args_for(
        model_dir, port, mem_fraction_static=0.2, base_gpu_id=gpu,
        colocated=kind == "tensor" and not on_cpu, on_cpu=on_cpu,
        extra_args={"skip_tokenizer_init": True, "dtype": dtype},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    server = launch.ManagedProcess(
        launch.build_server_command(args), f"{url}/health_generate", str(log)
    )
    server.start(env=launch.server_env(on_cpu))
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
    except Exception:
        server.stop()
        raise
    return server, url


def push_weights(url: str, kind: str, model_dir: str, device: str = "cuda") -> None:
    """Version 1 of the weights, from ``model_dir``, through ``kind`` (every body names it);
    the tensor and distributed updates inside a weight-update session, closed by a flush."""
    from safetensors.torch import load_file

    tensors = sorted(load_file(str(Path(model_dir) / "model.safetensors"), device=device).items())
    if kind == "disk":
        _post(
            url, "/update_weights_from_disk", client.update_weights_from_disk_payload(model_dir, 1)
        )
        return
    _post(url, transport.BEGIN_ENDPOINT, {})
    try:
        if kind == "tensor":
            bucket = transport.serialize_bucket(tensors)
            body = client.update_weights_from_tensor_payload(  # one server TP rank
                [bucket.text], 1, bucket.load_format
            )
            _post(url, transport.TENSOR_ENDPOINT, body)
            del bucket
        else:
            _stream(url, tensors, "gloo" if device == "cpu" else "nccl")
    finally:
        _post(url, transport.END_ENDPOINT, {})
    _post(url, transport.FLUSH_ENDPOINT, {})


def _stream(url: str, tensors: list[tuple[str, torch.Tensor]], backend: str) -> None:
    from megatron_armor.rollout.sglang.distributed import DistributedWeightSender

    sender = DistributedWeightSender(
        [(url, 1)], "127.0.0.1", node.free_port(), "armor-doctor", backend=backend
    )
    try:
        sender.connect(timeout_s=120)
        sender.send(tensors, version=1, timeout_s=120)
    finally:
        sender.close()


def _post(url: str, endpoint: str, body: dict) -> dict:
    loop = client.EventLoopThread()
    sglang = client.SGLangClient()
    try:
        loop.run(sglang.__aenter__())
        return loop.run(sglang.post(url, endpoint, body), timeout_s=300)
    finally:
        loop.run(sglang.__aexit__(None, None, None))
        loop.close()


def generate(url: str) -> tuple[list, list[float], list[int]]:
    """``SAMPLES`` samples of one prompt: ``[[prompt, response]]``, log-probs, versions."""
    prompt = [2, 5, 9, 17]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(1,))
    samples, logprobs, versions = [], [], []
    for i in range(SAMPLES):
        body = _post(url, "/generate", client.generate_payload(prompt, params, client.new_rid(), i))
        out = client.parse_generate_response(body, fallback_version=-1)
        samples.append([prompt, out.token_ids])
        logprobs += out.logprobs
        versions.append(out.weight_version)
    return samples, logprobs, versions


def trainer_logprobs(config: ArmorConfig, model_dir: str, samples: list) -> list[float]:
    settings = node.trainer_settings(config) | {"precision": "fp32", "fp8": {"enabled": False}}
    spec = {"model_dir": model_dir, "port": node.free_port(), "samples": samples,
            "trainer": settings, "temperature": 1.0}  # fmt: skip
    return node.run_probe(["trainer", json.dumps(spec)], timeout_s=300)["logprobs"]
