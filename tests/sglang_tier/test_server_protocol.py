"""Everything the project says to one SGLang server, said to the real server (sglang tier).

One CPU server (``SGLangEngine`` with ``on_cpu``, as ``orchestration.layout: cpu`` starts it) on
the tiny model, served with ``trainer.model_overrides`` ``{rope_theta: 40000}``: the launch
command and the API key; generation with log-probs against the megatron-core trainer's on the
same weights and overrides (and against the model without the override, which must differ: the
override reaches the served model); each weight transport inside SGLang's weight-update session
(disk; distributed over gloo in buckets; tensor with the CPU payload); release and resume in the
loop's order with generation paused, a request in flight; a paused server taken for alive,
and restarted paused; a request in flight interrupted by a weight push and continued under the
pushed weights, each token's version and log-prob as recorded (partial rollouts,
docs/orchestration.md "Bounded staleness").

Every update loads weights whose log-probs differ from the previous ones by far more than the
tolerance, so a push that did not arrive fails the comparison.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from sglang_servers import (
    MAX_TOL,
    MEAN_TOL,
    PROMPTS,
    TEMPERATURE,
    cpu_servers,
    logprob_gap,
    oracle,
    perturbed,
    push_distributed,
    push_tensor_inline,
    sample,
)

from megatron_armor.doctor import node
from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.sglang.client import (
    parse_generate_response,
    update_weights_from_distributed_payload,
)
from megatron_armor.rollout.sglang.launch import CPU_SERVER_ARGS

pytestmark = pytest.mark.sglang
OVERRIDES = {"rope_theta": 40000.0}  # the tiny model's own base is 10000
BUCKET = 256 << 10  # several buckets per push (the tiny model is ~1.7 MB)


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("sglang-protocol")
    model = tiny_dir / "model"
    with cpu_servers(model, log_dir, overrides=OVERRIDES) as engine:
        base = oracle(model, overrides=OVERRIDES).state_tensors()
        yield {"engine": engine, "model": model, "base": base, "log_dir": log_dir}


def call(engine, endpoint: str, body: dict | None = None, key: str | None = None):
    """``POST`` (or ``GET`` without a body) to the engine's first server; ``(status, body)``."""
    url = engine.servers[0].url + endpoint
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def assert_serves(engine, model, tensors, version: int, previous=None) -> tuple[float, float]:
    """Every sample names ``version`` and has the log-probs of ``tensors`` (not of
    ``previous``)."""
    out = sample(engine)
    assert {s.weight_version for g in out for s in g} == {version}
    mean, worst = logprob_gap(oracle(model, tensors, OVERRIDES), PROMPTS, out)
    assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)
    if previous is not None:
        stale, _ = logprob_gap(oracle(model, previous, OVERRIDES), PROMPTS, out)
        assert stale > 100 * MEAN_TOL, stale
    return mean, worst


def test_the_launch_command_and_the_api_key(served):
    """The server runs the command ``launch.py`` built, CPU additions included, and answers
    only the engine's key (``/health*`` stays open, as SGLang documents)."""
    engine = served["engine"]
    server = engine.servers[0]
    status, info = call(engine, "/server_info", key=engine.api_key)
    assert status == 200
    assert info["launch_command"] == " ".join(server.process.command[3:])
    for key, value in CPU_SERVER_ARGS.items():
        assert info[key] == value, key
    assert json.loads(info["json_model_override_args"]) == {
        "rope_parameters": {"rope_theta": 40000.0, "rope_type": "default"}
    }
    assert call(engine, "/generate", {"input_ids": [5, 6], "sampling_params": {}})[0] == 401
    assert call(engine, "/flush_cache", {}, key="not-the-key")[0] == 401
    assert call(engine, "/health")[0] == 200


def test_generation_logprobs_equal_the_trainers_under_the_override(served, tiny_dir):
    """The server's per-token log-probs against the megatron-core trainer's (``armor doctor``'s
    trainer probe, fp32, the same ``trainer.model_overrides``) on the sampled responses; and the
    override is served: without it the log-probs of the same tokens differ by far more."""
    engine, model = served["engine"], served["model"]
    out = sample(engine, n=4, max_new_tokens=24)
    samples = [[p, s.token_ids] for p, g in zip(PROMPTS, out, strict=True) for s in g]
    settings = {"transformer_impl": "local", "precision": "fp32", "micro_batch_tokens": 512,
                "model_overrides": OVERRIDES}  # fmt: skip
    spec = {"model_dir": str(model), "port": node.free_port(), "samples": samples,
            "trainer": settings, "temperature": TEMPERATURE}  # fmt: skip
    trainer = node.run_probe(["trainer", json.dumps(spec)], timeout_s=600)["logprobs"]
    served_lp = [lp for g in out for s in g for lp in s.logprobs]
    gaps = [abs(a - b) for a, b in zip(served_lp, trainer, strict=True)]
    mean, worst = sum(gaps) / len(gaps), max(gaps)
    print(f"server vs trainer: {len(gaps)} tokens, mean {mean:.2e}, max {worst:.2e} nats")
    assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)
    unchanged, _ = logprob_gap(oracle(model), PROMPTS, out)  # rope_theta 10000
    print(f"server vs the model without the override: mean {unchanged:.2e} nats")
    assert unchanged > 100 * MEAN_TOL, unchanged


def test_disk_update(served):
    engine, model = served["engine"], served["model"]
    new = perturbed(served["base"], seed=1)
    engine.update_weights(new, version=11)  # an HF dir saved here, /update_weights_from_disk
    assert_serves(engine, model, new, 11, previous=served["base"])
    served["current"] = new


def test_distributed_update_over_gloo_in_buckets(served):
    """``/init_weights_update_group`` once, then per bucket the metadata beside a gloo
    broadcast from this process (rank 0), inside ``begin`` / ``end``; SGLang refuses the same
    request outside a session (HTTP 400 naming ``begin_weight_update``)."""
    engine, model = served["engine"], served["model"]
    new = perturbed(served["base"], seed=2)
    body = update_weights_from_distributed_payload(
        **transport.bucket_metadata(new[:1]), version=12, group_name="armor-test-pp0"
    )
    status, text = call(engine, transport.DISTRIBUTED_ENDPOINT, body, key=engine.api_key)
    assert status == 400 and "begin_weight_update" in text
    sent = push_distributed(engine, new, 12, "armor-test-pp0", BUCKET)
    assert sent == sum(t.numel() * t.element_size() for _, t in new)
    assert_serves(engine, model, new, 12, previous=served.get("current"))
    served["current"] = new


def test_tensor_update_with_the_cpu_payload(served):
    """``/update_weights_from_tensor`` with the bucket's named tensors inline
    (``weights.serialize_bucket`` on a rank without a GPU), one request per bucket, inside the
    session; CUDA IPC handles are the gpu tier's (``tests/gpu/test_weight_sync_gpu.py``)."""
    engine, model = served["engine"], served["model"]
    new = perturbed(served["base"], seed=3)
    assert push_tensor_inline(engine, new, 13, BUCKET) > 1  # several buckets
    assert_serves(engine, model, new, 13, previous=served.get("current"))
    served["current"] = new


def test_release_and_resume_in_the_loops_order_with_a_request_in_flight(served):
    """``release_memory`` pauses generation first (a release while the scheduler is busy
    trips an assertion that ends the server): with a slowed-down request streaming, the server
    survives the release, takes back its weights, loads a push, takes back its KV cache and goes
    on; the request in flight finishes, and new samples come from the pushed weights."""
    engine, model = served["engine"], served["model"]
    assert call(engine, "/slow_down", {"forward_sleep_time": 0.2}, engine.api_key)[0] == 200
    first_chunk, finished = threading.Event(), {}
    stream = threading.Thread(target=_stream_one, args=(engine, first_chunk, finished))
    stream.start()
    try:
        assert first_chunk.wait(timeout=300), "the streamed request produced no token"
        engine.release_memory()
        assert call(engine, "/slow_down", {"forward_sleep_time": None}, engine.api_key)[0] == 200
        engine.resume_memory(["weights"])
        new = perturbed(served["base"], seed=4)
        engine.update_weights(new, version=14)
        engine.resume_memory(["kv_cache"])  # generation continues
    finally:
        stream.join(timeout=300)
    assert finished.get("reason") in ("length", "stop"), finished
    assert engine.health()
    # the servers loaded v14: the HF dirs of earlier disk pushes are gone
    assert sorted(p.name for p in Path(engine.weights_dir).iterdir()) == ["v14"]
    assert_serves(engine, model, new, 14, previous=served.get("current"))
    served["current"] = new


def test_a_paused_server_is_not_taken_for_stuck_and_a_restart_keeps_it_paused(served):
    """Colocated, between the release and the KV cache's return, a server generates nothing
    (its generation is paused): the call watch's probe (``wedged_servers``) and the heal's
    (``server_healthy``) ask its scheduler (``/server_info``) instead of ``/health_generate``,
    so a paused server is neither killed nor restarted for it; a server restarted there (a
    dead one, healed) releases what the pool has released, so the KV cache's resume that ends
    the sync finds it released (SGLang raises on a resume of a tag it holds)."""
    engine, model = served["engine"], served["model"]
    server = engine.servers[0]
    engine.release_memory()
    engine.resume_memory(["weights"])  # the sync's state while the trainer ranks push
    assert engine.wedged_servers(timeout_s=5) == []
    assert engine.server_healthy(server)
    engine.restart_server(server)  # as the heal restarts a dead one: out of rotation, paused
    new = perturbed(served["base"], seed=5)
    engine.update_weights(new, version=15)  # the heal's push of the pool's weights
    engine.resume_memory(["kv_cache"])
    engine.rejoin(server)
    assert engine.health() and engine.released == []
    assert_serves(engine, model, new, 15, previous=served.get("current"))
    served["current"] = new


def test_a_request_interrupted_by_a_push_goes_on_under_the_new_weights(served):
    """A partial rollout on the real server: a slowed-down request is in flight (its first
    tokens streamed), the servers pause (``retract``), load a push of version 16 and continue;
    the request is continued from its tokens, never restarted: its answer's
    ``meta_info.weight_versions`` give each token's version (``client.token_versions_of``),
    the tokens before the push have the old weights' log-probs and those after it the new
    weights' on the whole prefix (its KV cache recomputed under them)."""
    engine, model = served["engine"], served["model"]
    old_version, old = engine.weight_version(), served.get("current", served["base"])
    assert call(engine, "/slow_down", {"forward_sleep_time": 0.2}, engine.api_key)[0] == 200
    first_chunk, finished = threading.Event(), {}
    stream = threading.Thread(target=_stream_one, args=(engine, first_chunk, finished, 40))
    stream.start()
    new = perturbed(served["base"], seed=6)
    try:
        assert first_chunk.wait(timeout=300), "the streamed request produced no token"
        engine.pause_generation()
        assert call(engine, "/slow_down", {"forward_sleep_time": None}, engine.api_key)[0] == 200
        engine.update_weights(new, version=16)  # while paused: the cache flush is allowed
        engine.continue_generation()
    finally:
        stream.join(timeout=300)
    out = parse_generate_response(finished["body"], engine.weight_version())
    assert out.finish_reason in ("length", "stop") and out.weight_version == 16
    cut = out.token_versions.index(16)
    assert 1 <= cut < len(out.token_ids), out.token_versions
    assert out.token_versions == [old_version] * cut + [16] * (len(out.token_ids) - cut)
    for weights, span in ((old, slice(0, cut)), (new, slice(cut, None))):
        want = oracle(model, weights, OVERRIDES).teacher_forced_logprobs(
            PROMPTS[0], out.token_ids, TEMPERATURE
        )[span]
        gaps = [abs(a - b) for a, b in zip(want, out.logprobs[span], strict=True)]
        assert sum(gaps) / len(gaps) < MEAN_TOL and max(gaps) < MAX_TOL, gaps
    served["current"] = new


def _stream_one(
    engine, first_chunk: threading.Event, finished: dict, max_new_tokens: int = 64
) -> None:
    """A streamed ``/generate`` (temperature ``TEMPERATURE``, with log-probs); sets
    ``first_chunk`` at its first token; ``finished`` gets the finish reason and the last
    chunk's body (SGLang's non-incremental stream: the whole answer)."""

    async def run():
        body = {"input_ids": PROMPTS[0], "stream": True, "return_logprob": True,
                "sampling_params": {"temperature": TEMPERATURE, "max_new_tokens": max_new_tokens,
                                    "no_stop_trim": True}}  # fmt: skip
        headers = {"Authorization": f"Bearer {engine.api_key}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            url = engine.servers[0].url + "/generate"
            async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(600)) as resp:
                async for line in resp.content:
                    text = line.decode().strip()
                    if not text.startswith("data:") or text == "data: [DONE]":
                        continue
                    first_chunk.set()
                    chunk = json.loads(text[5:])
                    reason = chunk["meta_info"]["finish_reason"]
                    if reason:
                        finished["reason"], finished["body"] = reason["type"], chunk

    try:
        asyncio.run(run())
    except Exception as err:  # noqa: BLE001 - reported by the test's assertion
        finished["error"] = repr(err)
    finally:
        first_chunk.set()
