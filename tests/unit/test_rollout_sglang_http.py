"""SGLang backend over HTTP against a stand-in server (unit tier: the server runs in-process
on 127.0.0.1; ``test_orchestration_weight_transport.py`` runs this file as a server subprocess).

What the project says to SGLang is said to the real server in the sglang tier (``tests/sglang_tier``);
the stand-in is for what the real one cannot be made to show on cue: HTTP 503 and retries, a
request that outlives its timeout (abort, then retry), a 4xx that must not be retried, the seeds
each request carries (the CPU server cannot honour ``sampling_seed``), the router API generation
before the pinned one, and pure command and payload builders.

The stand-in implements SGLang's native endpoints with the request fields of SGLang's own
dataclasses (copied below from ``python/sglang/srt/managers/io_struct.py`` and
``sampling/sampling_params.py``) and rejects unknown fields, so a misspelt key fails here.
Run as a script (``python this_file.py --port P``) it serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web

from megatron_armor import heartbeat
from megatron_armor.config.schema import ArmorConfig, SGLangConfig
from megatron_armor.net import free_port
from megatron_armor.rollout.protocol import PartialRequest, SamplingParams
from megatron_armor.rollout.sglang import launch
from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.sglang.client import (
    ClientSettings,
    EventLoopThread,
    ServerDeadlineError,
    SGLangClient,
    SGLangError,
    generate_payload,
    init_weights_update_group_payload,
    parse_generate_response,
    update_weights_from_disk_payload,
    update_weights_from_distributed_payload,
    update_weights_from_tensor_payload,
)
from megatron_armor.rollout.sglang.engine import SGLangEngine
from megatron_armor.rollout.sglang.profile import ServerProfile, server_profile
from megatron_armor.rollout.sglang.router import RouterAdmin

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

# Request fields of SGLang's dataclasses (io_struct.py / sampling_params.py).
GENERATE_FIELDS = {
    "rid", "text", "input_ids", "input_embeds", "image_data", "sampling_params", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "stream", "log_metrics", "return_hidden_states", "modalities", "session_params", "lora_path",
    "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "priority",
    "return_routed_experts",
}  # fmt: skip
SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}  # fmt: skip
ROUTE_SHAPE = (2, 2)  # (layers, top-k) of the routes the stand-in answers
ENDPOINT_FIELDS = {
    "/abort_request": {"rid", "abort_all", "finished_reason", "abort_message"},
    "/update_weights_from_disk": {"model_path", "load_format", "abort_all_requests", "weight_version"},
    "/update_weights_from_tensor": {"serialized_named_tensors", "load_format", "flush_cache",
                                    "abort_all_requests", "weight_version", "disable_draft_model"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size",
                                   "group_name", "backend"},
    "/destroy_weights_update_group": {"group_name"},
    "/release_memory_occupation": {"tags"},
    "/resume_memory_occupation": {"tags"},
    "/pause_generation": {"mode"},
    "/continue_generation": {"torch_empty_cache"},
    "/begin_weight_update": {"selector"},
    "/end_weight_update": set(),
    "/flush_cache": set(),
    "/start_profile": {"output_dir", "start_step", "num_steps", "activities", "profile_by_stage",
                       "with_stack", "record_shapes", "profile_id", "merge_profiles",
                       "profile_prefix", "profile_stages"},
    "/stop_profile": set(),
}  # fmt: skip
# A subset of ServerArgs fields (server_args.py), enough for the launch builder.
SERVER_ARGS_FIELDS = {
    "model_path", "host", "port", "tp_size", "mem_fraction_static", "base_gpu_id",
    "enable_memory_saver", "max_running_requests", "dtype", "random_seed", "context_length",
    "cuda_graph_bs", "attention_backend", "enable_deterministic_inference",
    "json_model_override_args",
}  # fmt: skip


# --------------------------------------------------------------------------- stand-in server
class StandIn:
    """SGLang's native HTTP API with deterministic fake generation.

    Output token ``k`` is ``(sum(input_ids) + 7 k + seed + version) % 60 + 2``; a prompt that
    starts with 99 waits ``slow_s`` (or until aborted); ``fail_next`` answers HTTP 503.
    """

    def __init__(self) -> None:
        self.version = 0
        self.fail_next = 0
        self.slow_s = 5.0
        self.slow_first_attempt_only = False
        self.healthy = True
        self.calls: list[tuple[str, dict]] = []
        self.attempts: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.abort_all_event: asyncio.Event | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.group = None
        self.hang_control = False  # a control call that never answers (a wedged scheduler)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health_generate", self.health)
        app.router.add_post("/get_weights_by_name", self.get_weights_by_name)
        for endpoint in ENDPOINT_FIELDS:
            app.router.add_post(endpoint, self.control)
        return app

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``GetWeightsByNameReqInput`` (``name``, ``truncate_size``): a flat prefix."""
        body = await request.json()
        flat = self.weights[body["name"]].flatten()[: body.get("truncate_size", 100)]
        return web.json_response(flat.tolist())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/generate", body))
        bad = set(body) - GENERATE_FIELDS or set(body["sampling_params"]) - SAMPLING_FIELDS
        if bad:
            return web.json_response({"error": f"unknown fields {sorted(bad)}"}, status=400)
        rid = body["rid"]
        self.attempts[rid] = self.attempts.get(rid, 0) + 1
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=503)
        if body["input_ids"][0] == 99 and not (
            self.slow_first_attempt_only and self.attempts[rid] > 1
        ):
            if await self._wait_or_abort(rid):
                return web.json_response(self._response(body, aborted=True))
        return web.json_response(self._response(body, aborted=False))

    async def _wait_or_abort(self, rid: str) -> bool:
        if self.abort_all_event is None:
            self.abort_all_event = asyncio.Event()
        deadline = time.monotonic() + self.slow_s
        while time.monotonic() < deadline:
            if self.abort_all_event.is_set() or rid in self.aborted:
                return True
            await asyncio.sleep(0.01)
        return False

    def _response(self, body: dict, aborted: bool) -> dict:
        sp = body["sampling_params"]
        base = sum(body["input_ids"]) + sp.get("sampling_seed", 0) + self.version
        tokens, reason = [], {"type": "length", "length": sp["max_new_tokens"]}
        for k in range(1 if aborted else sp["max_new_tokens"]):
            tokens.append((base + 7 * k) % 60 + 2)
            if tokens[-1] in sp.get("stop_token_ids", []):
                reason = {"type": "stop", "matched": tokens[-1]}
                break
        if aborted:
            reason = {"type": "abort", "message": "Abort before prefill"}
        triples = [[-0.01 * (k + 1), t, None] for k, t in enumerate(tokens)]
        meta = {"id": body["rid"], "finish_reason": reason, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(tokens), "cached_tokens": 0, "weight_version": str(self.version),
                "output_token_logprobs": triples}  # fmt: skip
        if body.get("return_routed_experts"):
            meta["routed_experts"] = self.routes(len(body["input_ids"]) + len(tokens) - 1)
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    @staticmethod
    def routes(positions: int) -> str:
        """SGLang's ``meta_info.routed_experts`` for ``positions`` positions of a model with
        :data:`ROUTE_SHAPE` (base64 of int32 ``[positions, layers, k]``): expert
        ``(position + layer + j) % 8`` in slot ``j``."""
        layers, k = ROUTE_SHAPE
        grid = np.indices((positions, layers, k)).sum(axis=0) % 8
        return base64.b64encode(grid.astype(np.int32).tobytes()).decode("ascii")

    async def control(self, request: web.Request) -> web.Response:
        body = await request.json()
        endpoint = request.path
        while self.hang_control:
            await asyncio.sleep(0.05)
        self.calls.append((endpoint, body))
        bad = set(body) - ENDPOINT_FIELDS[endpoint]
        if bad:
            return web.json_response(
                {"success": False, "message": f"unknown {sorted(bad)}"}, status=400
            )
        handler = getattr(self, endpoint.strip("/"), None)
        result = await handler(body) if handler else None
        if "weight_version" in body:
            self.version = int(body["weight_version"])
        return web.json_response({"success": True, "message": "ok", **(result or {})})

    async def abort_request(self, body: dict) -> None:
        if body.get("abort_all"):
            if self.abort_all_event is None:
                self.abort_all_event = asyncio.Event()
            self.abort_all_event.set()
        self.aborted.add(body.get("rid", ""))

    async def update_weights_from_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        self.weights = load_file(os.path.join(body["model_path"], "model.safetensors"))
        return {"num_paused_requests": 0}

    async def init_weights_update_group(self, body: dict) -> None:
        def join():
            self.group = transport.new_weight_sync_group(
                body["master_address"], body["master_port"], body["rank_offset"],
                body["world_size"], body["group_name"], body["backend"], timeout_s=60,
            )  # fmt: skip

        await asyncio.get_running_loop().run_in_executor(None, join)

    async def destroy_weights_update_group(self, body: dict) -> None:
        import torch.distributed as dist

        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    async def update_weights_from_distributed(self, body: dict) -> None:
        import torch.distributed as dist

        def receive():
            for name, dtype, shape in zip(
                body["names"], body["dtypes"], body["shapes"], strict=True
            ):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(tensor, src=0, group=self.group)
                self.weights[name] = tensor

        await asyncio.get_running_loop().run_in_executor(None, receive)


class ServerThread:
    """Serve ``app`` on 127.0.0.1 in a background loop."""

    def __init__(self, app: web.Application) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = EventLoopThread()
        self.runner = web.AppRunner(app)
        self.loop.run(self._start())

    async def _start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def close(self) -> None:
        self.loop.run(self.runner.cleanup())
        self.loop.close()


@pytest.fixture
def standin():
    server = StandIn()
    thread = ServerThread(server.app())
    server.url = thread.url
    yield server
    thread.close()


def engine_for(urls, tmp_path=None, routes=None, profile=None, **cfg) -> SGLangEngine:
    settings = {"router": False, "max_retries": 2, "request_timeout_s": 10.0, **cfg}
    return SGLangEngine(
        "/models/tiny",
        SGLangConfig(**settings),
        urls=urls,
        weights_dir=str(tmp_path) if tmp_path else None,
        routes=routes,
        profile=profile,
    )


# --------------------------------------------------------------------------- unit tests
def test_launch_command_uses_server_args_flags():
    args = launch.server_args_for(
        "/m", 30001, tp=2, colocated=True, extra_args={"max_running_requests": 64}
    )
    cmd = launch.build_server_command(args, SERVER_ARGS_FIELDS, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    flags = " ".join(cmd[3:])
    for expected in ("--model-path /m", "--port 30001", "--tp-size 2", "--mem-fraction-static 0.7",
                     "--base-gpu-id 0", "--enable-memory-saver", "--max-running-requests 64"):  # fmt: skip
        assert expected in flags
    assert launch.args_to_cli({"cuda_graph_bs": [1, 2], "random_seed": None}) == [
        "--cuda-graph-bs",
        "1",
        "2",
    ]
    with pytest.raises(ValueError, match=r"\['max_runing_requests'\] that are not fields"):
        launch.build_server_command({**args, "max_runing_requests": 1}, SERVER_ARGS_FIELDS)
    longer = launch.server_args_for("/m", 1, context_length=10240,
                                    model_overrides={"rope_theta": 40000, "max_position_embeddings": 16384})  # fmt: skip
    flags = launch.build_server_command(longer, SERVER_ARGS_FIELDS, python="python")
    assert "--context-length 10240" in " ".join(flags)
    override = flags[flags.index("--json-model-override-args") + 1]
    # the RoPE override in the form SGLang's loaded config reads (config/model_overrides.py)
    assert json.loads(override) == {
        "max_position_embeddings": 16384,
        "rope_parameters": {"rope_theta": 40000.0, "rope_type": "default"},
    }


def test_a_custom_server_module_takes_the_same_flags():
    args = launch.server_args_for("/m", 30001)
    cmd = launch.build_server_command(args, SERVER_ARGS_FIELDS, python="py", module="site.serve")
    assert cmd[:3] == ["py", "-m", "site.serve"] and "--port" in cmd
    launch.require_sglang("json")  # an importable custom module needs no SGLang
    with pytest.raises(RuntimeError, match="rollout.sglang.server_module='no_such_server'"):
        launch.require_sglang("no_such_server")


def test_router_command_and_missing_sglang():
    cmd = launch.build_router_command(["http://a:1", "http://b:2"], 29000, python="python")
    assert cmd == ["python", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "29000",
                   "--worker-urls", "http://a:1", "http://b:2", "--policy", "cache_aware"]  # fmt: skip
    with pytest.raises(ValueError, match="policy='fastest'"):
        launch.build_router_command(["http://a:1"], 1, policy="fastest")
    if launch.server_arg_fields() is None:
        with pytest.raises(RuntimeError, match="requirements-gpu.txt"):
            launch.require_sglang()
        config = ArmorConfig()
        config.trainer.model_path, config.run.output_dir = "/models/tiny", "/nonexistent-run-root"
        with pytest.raises(RuntimeError, match="rollout.backend=sglang needs the sglang package"):
            SGLangEngine.from_config(config)


def test_parse_generate_response_in_sglang_format():
    body = {
        "text": " 4", "output_ids": [11, 12, 2],
        "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
                      "weight_version": "7", "completion_tokens": 3, "cached_tokens": 0,
                      "output_token_logprobs": [[-0.5, 11, None], [-1.25, 12, None], [-0.125, 2, None]]},
    }  # fmt: skip
    out = parse_generate_response(body, fallback_version=0)
    assert (out.token_ids, out.logprobs, out.finish_reason, out.weight_version) == (
        [11, 12, 2], [-0.5, -1.25, -0.125], "stop", 7)  # fmt: skip
    body["meta_info"].update(weight_version="default", finish_reason=None)
    out = parse_generate_response(body, fallback_version=3)
    assert (out.weight_version, out.finish_reason) == (3, "abort")
    with pytest.raises(SGLangError, match="output_token_logprobs"):
        parse_generate_response({"text": "", "meta_info": {}}, 0)


def test_a_response_across_a_weight_update_gets_each_tokens_version():
    """SGLang 0.5.23's ``meta_info.weight_versions`` (``srt/utils/weight_versions.py``): spans
    of output tokens per version a request ran under; one span: no per-token list."""
    triples = [[-0.5, 11, None], [-1.0, 12, None], [-0.25, 13, None]]
    spans = [{"version": "default", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    meta = {"finish_reason": {"type": "length"}, "weight_version": "4",
            "output_token_logprobs": triples, "weight_versions": spans}  # fmt: skip
    out = parse_generate_response({"meta_info": meta}, fallback_version=3)
    assert (out.weight_version, out.token_versions) == (4, [0, 4, 4])  # "default": version 0
    spans[0]["version"] = "3"
    out = parse_generate_response({"meta_info": meta}, fallback_version=0)
    assert out.token_versions == [3, 4, 4]
    meta["weight_versions"] = [{"version": "4", "start": 0, "end": 3}]
    assert parse_generate_response({"meta_info": meta}, 0).token_versions == []


def test_a_window_sends_each_request_with_its_tokens_and_its_limit(standin):
    """``generate_window``: the prompt and the response so far as ``input_ids``, the window's
    limit as ``max_new_tokens``, a seed per request; ``partial`` until ``max_new_tokens``."""
    engine = engine_for([standin.url])
    try:
        params = SamplingParams(max_new_tokens=6, seed=5, stop_token_ids=(1000,))
        requests = [PartialRequest([1, 2, 3]), PartialRequest([4, 5], [9, 9, 9, 9])]
        out = engine.generate_window(requests, params, 3)
        sent = [body for endpoint, body in standin.calls if endpoint == "/generate"]
        assert sorted(b["input_ids"] for b in sent) == [[1, 2, 3], [4, 5, 9, 9, 9, 9]]
        limits = {tuple(b["input_ids"]): b["sampling_params"]["max_new_tokens"] for b in sent}
        assert limits == {(1, 2, 3): 3, (4, 5, 9, 9, 9, 9): 2}
        assert len({b["sampling_params"]["sampling_seed"] for b in sent}) == 2
        assert [(len(o.token_ids), o.finish_reason) for o in out] == [(3, "partial"), (2, "length")]
    finally:
        engine.close()


def test_payloads_match_sglang_fields():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8, stop_token_ids=(5, 2), seed=1
    )
    body = generate_payload([1, 2], params, "rid-1", seed=123)
    assert set(body) <= GENERATE_FIELDS and set(body["sampling_params"]) <= SAMPLING_FIELDS
    assert (
        body["sampling_params"]["stop_token_ids"] == [2, 5]
        and body["sampling_params"]["sampling_seed"] == 123
    )
    bucket = [("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    dist_body = update_weights_from_distributed_payload(
        **transport.bucket_metadata(bucket), version=9, group_name="g"
    )
    assert set(dist_body) <= ENDPOINT_FIELDS["/update_weights_from_distributed"]
    assert dist_body["dtypes"] == ["bfloat16", "float32"] and dist_body["shapes"] == [[2, 3], [4]]
    assert dist_body["weight_version"] == "9"
    assert (
        set(init_weights_update_group_payload("h", 1, 1, 2, "g"))
        == ENDPOINT_FIELDS["/init_weights_update_group"] - set()
    )
    assert (
        set(update_weights_from_disk_payload("/p", 1))
        <= ENDPOINT_FIELDS["/update_weights_from_disk"]
    )
    tensor_body = update_weights_from_tensor_payload(["rank0", "rank1"], 3)
    assert set(tensor_body) <= ENDPOINT_FIELDS["/update_weights_from_tensor"]
    assert tensor_body["serialized_named_tensors"] == ["rank0", "rank1"]
    assert tensor_body["load_format"] == "flattened_bucket"
    assert tensor_body["flush_cache"] is False  # the session's end flushes once
    with pytest.raises(ValueError, match="weight_transport=tensor got CPU tensors"):
        transport.serialize_cuda_bucket(bucket)


def test_buckets_respect_size_and_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]
    buckets = list(transport.iter_buckets(tensors, bucket_bytes=80))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    with pytest.raises(ValueError, match="weight_bucket_mb"):
        list(transport.iter_buckets(tensors, 0))


def test_engine_generates_n_samples_per_prompt_with_distinct_seeds(standin):
    engine = engine_for([standin.url])
    try:
        params = SamplingParams(max_new_tokens=4, seed=5, stop_token_ids=(1000,))
        beats = heartbeat.beats()
        out = engine.generate([[1, 2, 3], [4, 5]], 3, params)
        assert heartbeat.beats() - beats == 6  # each sample's answer is progress
        assert [len(g) for g in out] == [3, 3]
        assert all(len(s.token_ids) == 4 and s.finish_reason == "length" for g in out for s in g)
        assert len({tuple(s.token_ids) for s in out[0]}) == 3  # per-sample sampling_seed
        assert out == engine.generate([[1, 2, 3], [4, 5]], 3, params)  # same seed, same samples
        assert all(s.logprobs == [-0.01, -0.02, -0.03, -0.04] for g in out for s in g)
        with pytest.raises(ValueError, match="one weight set"):
            engine.generate([[1]], 1, params, weights="ref")
    finally:
        engine.close()


def test_retries_on_503_and_gives_up_with_clear_error(standin):
    engine = engine_for([standin.url], max_retries=2)
    engine._client.settings.backoff_s = 0.01
    try:
        standin.fail_next = 2
        out = engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
        assert out[0][0].finish_reason == "length" and len(standin.attempts) == 1
        assert next(iter(standin.attempts.values())) == 3
        standin.fail_next = 5
        with pytest.raises(SGLangError, match="failed after 3 tries"):
            engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    finally:
        engine.close()


def test_timeout_aborts_the_request_then_retries(standin):
    standin.slow_s, standin.slow_first_attempt_only = 2.0, True
    loop = EventLoopThread()
    settings = ClientSettings(request_timeout_s=0.3, max_retries=1, backoff_s=0.01)

    async def run():
        async with SGLangClient(settings) as client:
            body = generate_payload([99, 1], SamplingParams(max_new_tokens=2), "slow-rid", None)
            return await client.generate(standin.url, body)

    try:
        body = loop.run(run(), timeout_s=30)
    finally:
        loop.close()
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    assert standin.attempts["slow-rid"] == 2
    aborts = [b for e, b in standin.calls if e == "/abort_request"]
    assert aborts == [{"rid": "slow-rid", "abort_all": False}]


def test_a_control_call_without_an_answer_names_the_server_and_the_call(standin):
    """A weight-update session that does not close (the server never answers its end): past
    the control deadline, a ``TimeoutError`` that names the server and the endpoint."""
    loop = EventLoopThread()
    settings = ClientSettings(control_timeout_s=0.3)
    standin.hang_control = True

    async def run():
        async with SGLangClient(settings) as client:
            return await client.post(standin.url, "/end_weight_update")

    try:
        with pytest.raises(ServerDeadlineError) as caught:
            loop.run(run(), timeout_s=30)
    finally:
        standin.hang_control = False
        loop.close()
    message = str(caught.value)
    assert isinstance(caught.value, TimeoutError)
    assert standin.url in message and "/end_weight_update" in message and "within 0.3s" in message


def test_client_errors_are_not_retried(standin):
    loop = EventLoopThread()

    async def run():
        async with SGLangClient(ClientSettings(max_retries=3)) as client:
            body = generate_payload([1], SamplingParams(), "r", None)
            body["sampling_params"]["temprature"] = 1.0
            return await client.generate(standin.url, body)

    try:
        with pytest.raises(SGLangError, match="HTTP 400.*temprature"):
            loop.run(run(), timeout_s=30)
    finally:
        loop.close()
    assert [e for e, _ in standin.calls] == ["/generate"]


def test_router_admin_speaks_both_router_apis():
    workers: dict[str, str] = {}
    legacy: list[str] = []

    async def list_workers(request):
        return web.json_response({"workers": [{"id": i, "url": u} for i, u in workers.items()]})

    async def add(request):
        workers[f"id{len(workers)}"] = (await request.json())["url"]
        return web.json_response({"status": "accepted"}, status=202)

    async def delete(request):
        workers.pop(request.match_info["wid"])
        return web.json_response({"status": "ok"})

    async def legacy_call(request):
        legacy.append(f"{request.path}?{request.query['url']}")
        return web.Response(text="ok")

    new_app, old_app = web.Application(), web.Application()
    new_app.router.add_get("/workers", list_workers)
    new_app.router.add_post("/workers", add)
    new_app.router.add_delete("/workers/{wid}", delete)
    old_app.router.add_post("/add_worker", legacy_call)
    old_app.router.add_post("/remove_worker", legacy_call)
    servers = [ServerThread(new_app), ServerThread(old_app)]
    loop = EventLoopThread()

    async def exercise(url):
        async with SGLangClient() as client:
            admin = RouterAdmin(client.session, url)
            await admin.add_worker("http://w:1")
            await admin.remove_worker("http://w:1")

    try:
        loop.run(exercise(servers[0].url), timeout_s=30)
        assert workers == {}
        loop.run(exercise(servers[1].url), timeout_s=30)
        assert legacy == ["/add_worker?http://w:1", "/remove_worker?http://w:1"]
    finally:
        loop.close()
        for s in servers:
            s.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="stand-in SGLang server for tests")
    parser.add_argument("--port", type=int, required=True)
    web.run_app(StandIn().app(), host="127.0.0.1", port=parser.parse_args().port, print=None)


# --------------------------------------------------------------------------- the reference pool
def dedicated_config(layout: str = "colocated", **sglang) -> ArmorConfig:
    config = ArmorConfig()
    config.trainer.model_path, config.run.output_dir = "/models/tiny", "/tmp/armor-runs"
    config.rollout.backend, config.rollout.ref_strategy = "sglang", "dedicated"
    config.orchestration.layout, config.trainer.world_size = layout, 4
    config.orchestration.rollout_gpus = 4 if layout == "disaggregated" else 0
    for key, value in sglang.items():
        setattr(config.rollout.sglang, key, value)
    return config


def flags_of(process: launch.ManagedProcess) -> str:
    return " ".join(process.command[3:])


def test_reference_pool_servers_get_their_own_ports_gpus_and_memory_share():
    # colocated: the reference servers share the policy servers' GPUs; SGLang reads
    # --mem-fraction-static against the memory free at its start (after the policy servers)
    config = dedicated_config("colocated", mem_fraction_static=0.5)
    config.rollout.sglang.ref_pool.mem_fraction = 0.25
    policy = SGLangEngine.from_config(config, "policy", start=False)
    ref = SGLangEngine.from_config(config, "ref", start=False)
    try:
        assert [s.url for s in ref.servers] == [f"http://127.0.0.1:{31000 + i}" for i in range(4)]
        assert [s.url for s in policy.servers][0] == "http://127.0.0.1:30000"
        p_flags = flags_of(policy.server_process(policy.servers[1], True, "/logs"))
        r_flags = flags_of(ref.server_process(ref.servers[1], True, "/logs"))
        assert "--mem-fraction-static 0.5 " in p_flags and "--base-gpu-id 1 " in p_flags
        assert "--mem-fraction-static 0.5 " in r_flags  # 0.25 / (1 - 0.5): a quarter of the GPU
        assert "--base-gpu-id 1 " in r_flags and "--port 31001" in r_flags
        assert (
            ref.server_process(ref.servers[1], True, "/logs").log_path == "/logs/sglang_ref_1.log"
        )
        assert ref.weights_dir.endswith("sglang_weights/ref/127.0.0.1")
    finally:
        policy.close()
        ref.close()
    # disaggregated: policy servers on rollout GPUs 0-1, reference servers on 2-3
    config = dedicated_config("disaggregated", mem_fraction_static=0.8)
    ref = SGLangEngine.from_config(config, "ref", start=False, gpu_ids=[6, 7])
    try:
        assert ref.pool.gpu_offsets() == [2, 3] and ref.pool.flag == 0.8
        assert flags_of(ref.server_process(ref.servers[1], False, None)).endswith("--base-gpu-id 7")
    finally:
        ref.close()
    config.rollout.ref_strategy = "swap"
    with pytest.raises(ValueError, match="no SGLang 'ref' pool"):
        SGLangEngine.from_config(config, "ref", start=False)


def test_stop_reaches_the_children_of_a_dead_server(tmp_path):
    """A crashed server's leader is gone but its children (SGLang's scheduler) still hold the
    GPU and the port: ``stop`` signals the whole process group anyway."""
    pid_file = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pid_file}; exit 0"
    process = launch.ManagedProcess(["sh", "-c", script], "http://127.0.0.1:9/health_generate")
    process.start()
    process.process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # alive, orphaned, in the server's process group
    process.stop(timeout_s=10)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        assert time.monotonic() < deadline, "the orphaned child survived stop()"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_stop_kills_at_once_a_server_started_with_sigterm_blocked():
    """A Ray actor starts its servers with the stop signals blocked (``ray_node.SHIELDED``,
    inherited through fork and exec): ``stop`` sees the blocked SIGTERM and sends SIGKILL
    instead of waiting out its timeout (600 s here, far beyond this test's limit)."""
    from megatron_armor.orchestration.actors.ray_node import SHIELDED

    started: list[launch.ManagedProcess] = []

    def start_shielded() -> None:  # the mask is per thread: block it in this one only
        signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
        process = launch.ManagedProcess(["sleep", "300"], "http://127.0.0.1:9/health_generate")
        process.start()
        started.append(process)

    thread = threading.Thread(target=start_shielded)
    thread.start()
    thread.join()
    process = started[0]
    assert launch.blocks_sigterm(process.process.pid)
    process.stop(timeout_s=600)
    assert process.process.returncode == -signal.SIGKILL
    plain = launch.ManagedProcess(["sleep", "300"], "http://127.0.0.1:9/health_generate")
    plain.start()
    assert not launch.blocks_sigterm(plain.process.pid)
    plain.stop(timeout_s=60)
    assert plain.process.returncode == -signal.SIGTERM  # the graceful signal first


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return "gone"


def test_routed_experts_decode_compactly_and_survive_a_checkpoint():
    """``meta_info.routed_experts`` as SGLang 0.5.23 sends it (base64 of the int32 ids of
    ``[prompt + output - 1, layers, top_k]``) decodes into the sample's compact routes:
    ``uint8`` up to 256 experts, ``int16`` above; a size that disagrees or a missing field is
    an error naming the cause; the routes survive the JSON of a batch-in-flight checkpoint."""
    import base64
    import dataclasses
    import json

    import numpy as np

    from megatron_armor.rollout.sglang.client import parse_routed_experts
    from megatron_armor.types import Sample, sample_from_dict

    rng = np.random.default_rng(0)
    prompt, response, layers, k = [5, 6, 7], [8, 9], 3, 2
    positions = len(prompt) + len(response) - 1
    for experts, dtype in ((128, "uint8"), (300, "int16")):
        ids = rng.integers(0, experts, (positions, layers, k)).astype(np.int32)
        meta = {"routed_experts": base64.b64encode(ids.tobytes()).decode("utf-8")}
        routes = parse_routed_experts(meta, layers, k, positions)
        assert routes.dtype == dtype and routes.shape == [positions, layers, k]
        assert np.array_equal(routes.array().astype(np.int32), ids)
    assert routes.array().itemsize == 2 and len(base64.b64decode(routes.data)) == ids.size * 2
    with pytest.raises(SGLangError, match="expected 5 positions x 3 layers x top-2 = 30"):
        parse_routed_experts(meta, layers, k, positions + 1)
    with pytest.raises(SGLangError, match="--enable-return-routed-experts"):
        parse_routed_experts({}, layers, k, positions)
    sample = Sample("q", prompt, response, [-0.5, -0.25], routed_experts=routes)
    restored = sample_from_dict(json.loads(json.dumps(dataclasses.asdict(sample))))
    assert restored == sample and np.array_equal(restored.routed_experts.array(), routes.array())
    plain = dataclasses.asdict(Sample("q", prompt, response))
    del plain["routed_experts"]  # a checkpoint written before the field existed
    assert sample_from_dict(json.loads(json.dumps(plain))).routed_experts is None


def test_an_engine_built_for_routes_asks_for_them_and_decodes_them(standin):
    """``routes=(layers, k)`` (a run that replays the engine's routes) launches the servers
    with ``--enable-return-routed-experts``, asks every ``/generate`` for the experts and
    hands each sample its ``[prompt + response - 1, layers, k]`` ids; an engine without
    ``routes`` asks for none (a dense model, or a run that does not replay them)."""
    engine = engine_for([standin.url], routes=ROUTE_SHAPE)
    plain = engine_for([standin.url])
    try:
        params = SamplingParams(max_new_tokens=3, seed=1)
        out = engine.generate([[1, 2, 3], [4, 5]], 2, params)
        for prompt, group in zip([[1, 2, 3], [4, 5]], out, strict=True):
            for sample in group:
                positions = len(prompt) + len(sample.token_ids) - 1
                expected = np.indices((positions, *ROUTE_SHAPE)).sum(axis=0) % 8
                assert sample.routed_experts.dtype == "uint8"
                assert np.array_equal(sample.routed_experts.array(), expected)
        asked = [body.get("return_routed_experts") for _, body in standin.calls]
        assert asked == [True] * 4
        assert all(s.routed_experts is None for g in plain.generate([[1, 2]], 2, params) for s in g)
        assert [body.get("return_routed_experts") for _, body in standin.calls[4:]] == [None] * 2
        server = engine.servers[0]
        assert "--enable-return-routed-experts" in flags_of(
            engine.server_process(server, False, None)
        )
        assert "routed" not in flags_of(plain.server_process(plain.servers[0], False, None))
    finally:
        engine.close()
        plain.close()


def test_routes_are_asked_for_only_when_the_run_replays_them(tmp_path):
    """``wants_engine_routes``: a mixture-of-experts policy whose trainer replays the engine's
    routes (``trainer.moe.routing_replay: r3``); never a dense model, never another setting."""
    import json

    from megatron_armor.config.moe import route_shape, wants_engine_routes

    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_local_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 8}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(moe))
    assert route_shape(str(tmp_path)) == (3, 2)
    config = ArmorConfig()
    config.trainer.model_path = str(tmp_path)
    for replay in ("off", "r2", "r3"):
        config.trainer.moe.routing_replay = replay
        assert wants_engine_routes(config) == (replay == "r3"), replay
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert route_shape(str(tmp_path)) is None and not wants_engine_routes(config)


def test_routes_from_sglang_on_cpu_are_refused_at_load(tmp_path):
    """SGLang 0.5.23 returns routes only on a GPU: a run that would ask CPU servers for them
    is refused with the choices that work; the embedded engine and GPU layouts are not."""
    import json

    from megatron_armor.config.moe import engine_route_problems

    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 8}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(moe))
    config = ArmorConfig()
    config.trainer.model_path = str(tmp_path)
    config.rollout.backend, config.orchestration.layout = "sglang", "cpu"
    config.trainer.moe.routing_replay = "r3"
    (problem,) = engine_route_problems(config)
    assert "routing_replay=r3" in problem and "rollout.backend=torch" in problem
    config.orchestration.layout = "colocated"
    assert list(engine_route_problems(config)) == []
    config.rollout.backend, config.orchestration.layout = "torch", "cpu"
    assert list(engine_route_problems(config)) == []
    config.rollout.backend, config.trainer.moe.routing_replay = "sglang", "r2"
    assert list(engine_route_problems(config)) == []


def test_profiled_servers_capture_the_chosen_steps_only(standin):
    """logging.profile=torch: the servers' own profiler for step 2 only, traces under the run;
    nsys on a Ray cluster: each server under its own nsys session, asked for a CUDA profiler
    range; nsys under launch/profile.sh: nothing to ask (the driver's session follows them)."""
    torch_run = ServerProfile("torch", (2,), "/runs/r/profile", own_nsys=False)
    engine = engine_for([standin.url], profile=torch_run)
    for step in (1, 2, 3):
        engine.profile_begin(step)
        engine.profile_end(step)
    asked = [(e, b) for e, b in standin.calls if "profile" in e]
    assert asked == [("/start_profile", {"activities": ["CPU", "GPU"],
                                         "output_dir": "/runs/r/profile/sglang_0"}),
                     ("/stop_profile", {})]  # fmt: skip
    engine.close()
    command = ["python", "-m", "sglang.launch_server", "--port", "1"]
    cluster = ServerProfile("nsys", (2,), "/runs/r/profile", own_nsys=True)
    wrapped = cluster.command(command, "sglang_ref_1")
    assert wrapped[:2] == ["nsys", "profile"] and wrapped[-5:] == command
    assert "--output=/runs/r/profile/sglang_ref_1_%p" in wrapped
    assert "--capture-range=cudaProfilerApi" in wrapped
    assert cluster.start_payload("s") == {"activities": ["CUDA_PROFILER"]}
    local = ServerProfile("nsys", (2,), "/runs/r/profile", own_nsys=False)
    assert local.command(command, "sglang_0") == command and local.start_payload("s") is None
    config = ArmorConfig()
    config.logging.profile, config.logging.profile_steps = "nsys", [3]
    config.orchestration.ray_address = "10.0.0.1:6379"
    assert server_profile(config) == ServerProfile("nsys", (3,), "runs/armor/profile", True)
