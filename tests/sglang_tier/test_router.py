"""sglang-router 0.3.2 over two real SGLang servers on CPU (sglang tier).

The engine generates through the router and pushes weights to each server (the router answers
404 to ``/update_weights_*``); a server restarted out of rotation leaves the router and
rejoins it (``RouterAdmin`` against the real router), then serves the pushed weights again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

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
)
from sglang_servers import sample as generate

from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang.client import update_weights_from_disk_payload

pytestmark = pytest.mark.sglang


def post(url: str, body: dict, key: str) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def server_requests(engine) -> list[int]:
    """Generate requests each server's log shows (``POST /generate``)."""
    counts = []
    for server in engine.servers:
        with open(server.process.log_path, errors="replace") as f:
            counts.append(sum('"POST /generate HTTP' in line for line in f))
    return counts


def test_router_over_two_servers_with_a_push_and_a_restart(tiny_dir, tmp_path):
    model = tiny_dir / "model"
    with cpu_servers(model, tmp_path, num_engines=2, router=True) as engine:
        assert engine.router_url is not None
        base = oracle(model).state_tensors()
        new = perturbed(base, seed=5)
        url = engine.router_url + "/update_weights_from_disk"
        assert post(url, update_weights_from_disk_payload(str(model), 1), engine.api_key) == 404
        engine.update_weights(new, version=21)  # to each server, not through the router
        before = server_requests(engine)
        out = generate(engine, n=4)
        after = server_requests(engine)
        assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)
        assert {s.weight_version for g in out for s in g} == {21}
        mean, worst = logprob_gap(oracle(model, new), PROMPTS, out)
        assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)

        restarted = engine.servers[1]
        engine.restart_server(restarted)  # out of the router, restarted on the base weights
        assert not restarted.serving
        out = generate(engine, n=4)  # only the other server answers meanwhile
        assert {s.weight_version for g in out for s in g} == {21}
        engine.update_weights_from_disk(str(engine.weights_dir) + "/v21", 21, [restarted])
        engine.rejoin(restarted)
        # prompts no server has cached: the cache-aware router sends them to the emptier tree
        fresh = [[40 + i, 41 + i, 42 + i] for i in range(0, 30, 3)]
        before = server_requests(engine)
        out = engine.generate(fresh, 2, SamplingParams(temperature=TEMPERATURE, max_new_tokens=8))
        after = server_requests(engine)
        assert after[1] > before[1], (before, after)  # back behind the router
        assert {s.weight_version for g in out for s in g} == {21}
        mean, worst = logprob_gap(oracle(model, new), fresh, out)
        assert mean < MEAN_TOL and worst < MAX_TOL, (mean, worst)
