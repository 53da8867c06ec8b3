"""Async HTTP client for SGLang's native API (aiohttp).

Request / response formats (SGLang ``GenerateReqInput`` and ``SamplingParams``):

- ``POST /generate`` ``{"rid", "input_ids": [int], "sampling_params": {...}, "return_logprob": true}``
  -> ``{"text", "output_ids", "meta_info": {"output_token_logprobs": [[logprob, token_id, text|null], ...],
  "finish_reason": {"type": "stop"|"length"|"abort", ...}, "weight_version": str, ...}}``.
- with ``"return_routed_experts": true`` (a server launched with
  ``--enable-return-routed-experts``), ``meta_info.routed_experts``: base64 int32 expert ids,
  ``[prompt + output - 1, layers, top_k]`` (:func:`parse_routed_experts`).
- ``meta_info.weight_versions`` (``[{"version", "start", "end"}]``, output tokens): the
  weight versions a request was generated under when a weight update came while it ran
  (paused with ``/pause_generation`` ``retract``, continued with ``/continue_generation``).
- ``POST /abort_request`` ``{"rid": str, "abort_all": bool}`` (``AbortReq``).
- Weight and memory endpoints answer ``{"success": bool, "message": str}`` (HTTP 400 on failure).

Every request body is built by a pure ``*_payload`` function below, named after its endpoint;
``tests/unit/test_sglang_contract.py`` checks each against the request class of the pinned
SGLang wheel (``sglang.srt.managers.io_struct``), where unknown keys are silently ignored.

Reliability: at most ``max_concurrency`` requests in flight; connection errors, timeouts and
HTTP 5xx are retried ``max_retries`` times with exponential backoff (a timed-out generation
is aborted by ``rid`` first so the server does not keep decoding it); HTTP 4xx is an error
at once, with the server's message; a control call without an answer within
``control_timeout_s`` is a :class:`ServerDeadlineError` naming the server and the call.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from megatron_armor.algo.staleness import spans_to_versions
from megatron_armor.rollout.protocol import GenerationOutput, SamplingParams
from megatron_armor.types import RoutedExperts


class SGLangError(RuntimeError):
    """An SGLang endpoint answered with an error (after retries where they apply)."""


class ServerDeadlineError(TimeoutError):
    """A control call (a weight-update session, weights, memory) got no answer from its server
    within ``ClientSettings.control_timeout_s``: the message names the server and the call. A
    ``TimeoutError``, so the run treats it as a fault of the worker that owns the server
    (``orchestration/actors/faults.py``)."""


class ServerError(Exception):
    """HTTP 5xx: the server is overloaded, starting or restarting; worth a retry."""


RETRYABLE = (aiohttp.ClientConnectionError, asyncio.TimeoutError, ServerError)


def sample_seed(seed: int, prompt_index: int, sample_index: int, n: int) -> int:
    """A distinct, reproducible ``sampling_seed`` per sample (same ``seed`` -> same seeds)."""
    return (seed * 1_000_003 + prompt_index * n + sample_index) % (2**31 - 1)


def sampling_params_payload(params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """SGLang ``sampling_params`` for :class:`SamplingParams`.

    ``no_stop_trim`` keeps the stop token in ``output_ids`` (the embedded engine does too);
    ``sampling_seed`` is honoured by servers started with ``enable_deterministic_inference``.
    """
    payload: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop_token_ids:
        payload["stop_token_ids"] = sorted(params.stop_token_ids)
    if seed is not None:
        payload["sampling_seed"] = seed
    return payload


def generate_payload(
    input_ids: list[int],
    params: SamplingParams,
    rid: str,
    seed: int | None,
    return_routed_experts: bool = False,
) -> dict:
    """Body of ``POST /generate`` for one sample of one prompt; ``return_routed_experts``
    asks a mixture-of-experts server (launched with ``--enable-return-routed-experts``) for
    the experts of every position (:func:`parse_routed_experts`)."""
    payload = {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": sampling_params_payload(params, seed),
        "return_logprob": True,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def parse_routed_experts(
    meta: dict[str, Any], num_layers: int, topk: int, positions: int
) -> RoutedExperts:
    """The routes of a ``/generate`` answer, compacted (``types.RoutedExperts``).

    SGLang 0.5.23 (``srt/state_capturer/routed_experts.py``, ``detokenizer_manager``) sends
    ``meta_info.routed_experts`` as base64 of the int32 ids of shape ``[positions, layers,
    topk]`` (C order): positions ``[0, prompt + output - 1)`` with ``routed_experts_start_len``
    0, every hidden layer (a dense layer's rows are zeros). ``positions`` is what the sample
    needs (``len(prompt) + len(response) - 1``); a count or size that disagrees is an error,
    not a silent misalignment."""
    data = meta.get("routed_experts")
    if not isinstance(data, str):
        raise SGLangError(
            "/generate answered without meta_info.routed_experts: launch the server with "
            "--enable-return-routed-experts (server_args_for(return_routed_experts=True))"
        )
    ids = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    per_position = num_layers * topk
    if ids.size != positions * per_position:
        raise SGLangError(
            f"/generate: meta_info.routed_experts holds {ids.size} ids, expected {positions} "
            f"positions x {num_layers} layers x top-{topk} = {positions * per_position}"
        )
    return RoutedExperts.from_array(ids.reshape(positions, num_layers, topk))


def abort_payload(rid: str | None) -> dict[str, Any]:
    """Body of ``POST /abort_request`` (``AbortReq``): one request by ``rid``, or all."""
    return {"rid": rid or "", "abort_all": rid is None}


def update_weights_from_tensor_payload(
    serialized: list[str], version: int, load_format: str | None = "flattened_bucket"
) -> dict:
    """Body of ``/update_weights_from_tensor`` (``UpdateWeightsFromTensorReqInput``) for one
    bucket: ``serialized[t]`` is the base64 ``MultiprocessingSerializer`` text of the bucket as
    the server's TP rank ``t`` opens it (SGLang's ``TpModelWorker`` reads
    ``serialized_named_tensors[tp_rank]``), so the list has one entry per server TP rank;
    ``load_format``: ``flattened_bucket`` (CUDA IPC of one flat buffer) or ``None`` (a list of
    named tensors: the CPU form, ``weights.serialize_bucket``). Inside a weight-update session;
    no cache flush per bucket (the session's end flushes once, ``SGLangEngine.end_weight_update``)."""
    return {
        "serialized_named_tensors": list(serialized),
        "load_format": load_format,
        "flush_cache": False,
        "weight_version": str(version),
    }


def update_weights_from_distributed_payload(
    names: list[str], dtypes: list[str], shapes: list[list[int]], version: int, group_name: str
) -> dict:
    """Body of ``/update_weights_from_distributed`` (``UpdateWeightsFromDistributedReqInput``):
    the receivers allocate ``names[i]`` as ``dtypes[i]`` (``'bfloat16'``) of ``shapes[i]``.
    Inside a weight-update session; no flush per bucket (as the tensor payload)."""
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(shape) for shape in shapes],
        "group_name": group_name,
        "flush_cache": False,
        "weight_version": str(version),
    }


def init_weights_update_group_payload(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
) -> dict:
    """Body of ``/init_weights_update_group`` (``InitWeightsUpdateGroupReqInput``)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def destroy_weights_update_group_payload(group_name: str) -> dict:
    """Body of ``/destroy_weights_update_group`` (``DestroyWeightsUpdateGroupReqInput``)."""
    return {"group_name": group_name}


def update_weights_from_disk_payload(model_path: str, version: int) -> dict:
    """Body of ``/update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``)."""
    return {"model_path": model_path, "weight_version": str(version)}


def pause_generation_payload() -> dict:
    """Body of ``/pause_generation`` (``PauseGenerationReqInput``): ``retract`` moves running
    requests back to the waiting queue (none are lost; they go on after
    ``/continue_generation``, their KV cache recomputed under the weights then loaded: the
    cache flush of a weight update is allowed while paused) and leaves the scheduler idle
    for a memory release."""
    return {"mode": "retract"}


RELEASED_TAGS = ("weights", "kv_cache")
"""The memory a colocated server hands the trainer and takes back, named: SGLang 0.5.23's tags
(``srt/constants.py``) but ``cuda_graph``. A release without tags would pause the CUDA graphs'
memory too, which the loop never resumes (a resume of a tag not released raises in the
scheduler's ``offload_tags.remove``), so every release and every resume names these."""


PROFILE_START, PROFILE_STOP = "/start_profile", "/stop_profile"
"""A server's profiler (``rollout/sglang/profile.py``: the body of a start; a stop has none)."""


def release_memory_occupation_payload(tags: list[str] | None = None) -> dict:
    """Body of ``/release_memory_occupation`` (``ReleaseMemoryOccupationReqInput``): ``tags``
    among :data:`RELEASED_TAGS` (``None``: the weights and the KV cache)."""
    return {"tags": known_tags(tags, "release")}


def resume_memory_occupation_payload(tags: list[str] | None) -> dict:
    """Body of ``/resume_memory_occupation`` (``ResumeMemoryOccupationReqInput``); ``tags``
    among :data:`RELEASED_TAGS` (``None``: all of them, never ``cuda_graph``)."""
    return {"tags": known_tags(tags, "resume")}


def known_tags(tags: list[str] | None, verb: str) -> list[str]:
    """``tags`` (``None``: :data:`RELEASED_TAGS`), each one of :data:`RELEASED_TAGS`."""
    chosen = list(RELEASED_TAGS) if tags is None else list(tags)
    unknown = sorted(set(chosen) - set(RELEASED_TAGS))
    if unknown:
        raise ValueError(
            f"{verb} of memory tags {unknown}: only {list(RELEASED_TAGS)} are released"
        )
    return chosen


def parse_generate_response(body: dict[str, Any], fallback_version: int) -> GenerationOutput:
    """:class:`GenerationOutput` from a ``/generate`` response body.

    Token ids and log-probs come from ``meta_info.output_token_logprobs`` (``[logprob, id, text]``
    triples); ``finish_reason`` is ``meta_info.finish_reason.type`` (``None`` while unfinished is
    read as ``abort``); the version is ``meta_info.weight_version`` when it is an integer; a
    response generated across weight updates gets each token's version from
    ``meta_info.weight_versions`` (:func:`token_versions_of`).
    """
    meta = body.get("meta_info")
    if meta is None or "output_token_logprobs" not in meta:
        raise SGLangError(
            f"/generate response has no meta_info.output_token_logprobs: {str(body)[:300]}"
        )
    triples = meta["output_token_logprobs"]
    token_ids = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) if t[0] is not None else float("nan") for t in triples]
    if "output_ids" in body and list(body["output_ids"]) != token_ids:
        raise SGLangError("/generate: output_ids disagree with output_token_logprobs token ids")
    finish = meta.get("finish_reason") or {"type": "abort"}
    reason = finish["type"] if isinstance(finish, dict) else str(finish)
    version = _version(meta.get("weight_version"), fallback_version)
    versions = token_versions_of(meta, len(token_ids))
    return GenerationOutput(token_ids, logprobs, reason, version, token_versions=versions)


def token_versions_of(meta: dict[str, Any], num_tokens: int) -> list[int]:
    """Each output token's weight version from ``meta_info.weight_versions`` (SGLang 0.5.23,
    ``srt/utils/weight_versions.py``: spans ``[start, end)`` of output tokens, one per version
    the request ran under); ``[]`` when it ran under one version only (or the server sent no
    spans). A span's version that is not an integer is a server's initial ``default``: the
    checkpoint it was launched with, the project's version 0 (every engine starts there)."""
    spans = meta.get("weight_versions") or []
    if len({str(span["version"]) for span in spans}) < 2:
        return []
    triples = [(_version(s["version"], 0), int(s["start"]), int(s["end"])) for s in spans]
    return spans_to_versions(triples, num_tokens)


def _version(value: Any, fallback: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback


@dataclass
class ClientSettings:
    """Limits for :class:`SGLangClient` (from ``rollout.sglang``)."""

    max_concurrency: int = 512
    request_timeout_s: float = 3600.0
    max_retries: int = 3
    backoff_s: float = 0.5
    control_timeout_s: float = 600.0
    """Timeout of weight / memory / abort calls."""
    api_key: str = field(default="", repr=False)
    """The servers' ``--api-key`` (sent as ``Authorization: Bearer KEY``; never printed)."""


class SGLangClient:
    """Talks to one or more SGLang servers (or a router). Use as ``async with``."""

    def __init__(self, settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    async def __aenter__(self) -> SGLangClient:
        key = self.settings.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=headers
        )
        self._slots = asyncio.Semaphore(self.settings.max_concurrency)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("SGLangClient used outside 'async with'")
        return self._session

    async def generate(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        """``POST {url}/generate`` with retries; the response body."""
        async with self._slots:
            for attempt in range(self.settings.max_retries + 1):
                try:
                    return await self._post_once(
                        url, "/generate", payload, self.settings.request_timeout_s
                    )
                except RETRYABLE as err:
                    if isinstance(err, asyncio.TimeoutError):
                        await self.abort(url, payload.get("rid"))
                    if attempt == self.settings.max_retries:
                        raise SGLangError(
                            f"{url}/generate failed after {attempt + 1} tries ({err!r}); raise "
                            "rollout.sglang.max_retries / request_timeout_s or check the server"
                        ) from err
                    await asyncio.sleep(self.settings.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def post(self, url: str, endpoint: str, payload: dict[str, Any] | None = None) -> dict:
        """A control call (weights, memory): raises :class:`SGLangError` unless it succeeded."""
        limit = self.settings.control_timeout_s
        try:
            body = await self._post_once(url, endpoint, payload or {}, limit)
        except TimeoutError as err:
            raise ServerDeadlineError(
                f"SGLang server {url}: {endpoint} got no answer within {limit:g}s (the "
                "control-call deadline): the server is stuck"
            ) from err
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"{url}{endpoint} failed: {body.get('message')}")
        return body

    async def abort(self, url: str, rid: str | None = None) -> None:
        """``POST /abort_request``: one request by ``rid``, or all when ``rid`` is ``None``."""
        payload = abort_payload(rid)
        try:
            await self._post_once(url, "/abort_request", payload, self.settings.control_timeout_s)
        except (*RETRYABLE, SGLangError):
            pass  # best effort: the server may already be gone or the request finished

    async def healthy(self, url: str, timeout_s: float = 30.0) -> bool:
        """``GET /health_generate`` answered 200 (it runs a one-token generation)."""
        return await self._answers(url, "/health_generate", timeout_s)

    async def scheduler_answers(self, url: str, timeout_s: float = 30.0) -> bool:
        """``GET /server_info`` answered 200: the scheduler took a control request. A server
        with generation paused (its memory released) does that, and no generation."""
        return await self._answers(url, "/server_info", timeout_s)

    async def _answers(self, url: str, endpoint: str, timeout_s: float) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(f"{url}{endpoint}", timeout=timeout) as response:
                return response.status == 200
        except (*RETRYABLE, aiohttp.ClientError):
            return False

    async def _post_once(self, url: str, endpoint: str, payload: dict, timeout_s: float) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.post(f"{url}{endpoint}", json=payload, timeout=timeout) as response:
            if response.status >= 500:
                raise ServerError(f"HTTP {response.status} from {url}{endpoint}")
            if response.status >= 400:
                raise SGLangError(
                    f"{url}{endpoint}: HTTP {response.status}: {(await response.text())[:500]}"
                )
            if response.content_type == "application/json":
                return await response.json()
            return {"success": True, "message": await response.text()}


def new_rid() -> str:
    """A fresh request id (``rid``) so a request can be aborted by id."""
    return uuid.uuid4().hex


class EventLoopThread:
    """An asyncio loop in a daemon thread: sync code submits coroutines and waits on them.

    Lets the synchronous :class:`RolloutEngine` API drive the async client, and lets a
    trainer rank keep HTTP requests in flight while it blocks in an NCCL broadcast.
    """

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="sglang-client"
        )
        self._thread.start()

    def submit(self, coro):
        """Schedule ``coro``; returns a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout_s: float | None = None):
        """Run ``coro`` on the loop and wait for its result."""
        return self.submit(coro).result(timeout=timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
