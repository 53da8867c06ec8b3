"""SGLang weight sync and fault handling against stand-in server subprocesses (dist tier).

The server is ``test_rollout_sglang_http.py`` run as a script: it answers SGLang's endpoints,
joins the weight-sync process group on ``/init_weights_update_group`` (gloo here, NCCL on
GPUs) and receives the broadcasts announced by ``/update_weights_from_distributed``.
"""

from __future__ import annotations

import json
import socket
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_armor.config.schema import SGLangConfig
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang import launch
from megatron_armor.rollout.sglang.distributed import DistributedWeightSender
from megatron_armor.rollout.sglang.engine import SGLangEngine

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent
SERVER = HERE / "test_rollout_sglang_http.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(tmp_path) -> launch.ManagedProcess:
    port = free_port()
    cmd = [sys.executable, str(SERVER), "--port", str(port)]
    process = launch.ManagedProcess(
        cmd, f"http://127.0.0.1:{port}/health_generate", str(tmp_path / "server.log")
    )
    process.start(env={"PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1"})
    process.wait_healthy(timeout_s=90, poll_s=0.2)
    return process


def url_of(process: launch.ManagedProcess) -> str:
    return process.health_url.removesuffix("/health_generate")


def weights_by_name(url: str, name: str) -> list[float]:
    body = json.dumps({"name": name, "truncate_size": 100}).encode()
    request = urllib.request.Request(
        f"{url}/get_weights_by_name", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def engine_for(url: str, **cfg) -> SGLangEngine:
    return SGLangEngine(
        "/models/tiny", SGLangConfig(router=False, max_retries=1, **cfg), urls=[url]
    )


@pytest.mark.timeout(180)
def test_distributed_transport_broadcasts_buckets_over_a_weight_sync_group(tmp_path):
    servers = []
    for i in range(2):
        (tmp_path / f"s{i}").mkdir()
        try:
            servers.append(start_server(tmp_path / f"s{i}"))
        except BaseException:
            for process in servers:
                process.stop()
            raise
    targets = [(url_of(p), 1) for p in servers]
    sender = DistributedWeightSender(
        targets, "127.0.0.1", free_port(), "armor-pp0", bucket_bytes=64, backend="gloo"
    )
    try:
        sender.connect(timeout_s=90)
        assert sender.world_size == 3 and sender.rank_offsets() == [1, 2]
        tensors = [(f"w{i}", torch.randn(3, 4)) for i in range(3)] + [("h", torch.randn(2).half())]
        assert sender.send(iter(tensors), version=4, timeout_s=90) == 3 * 48 + 4
        for url, _ in targets:
            for name, tensor in tensors:
                assert torch.equal(
                    torch.tensor(weights_by_name(url, name), dtype=tensor.dtype), tensor.flatten()
                )
            engine = engine_for(url)
            try:
                assert (
                    engine.generate([[1]], 1, SamplingParams(max_new_tokens=1))[0][0].weight_version
                    == 4
                )
            finally:
                engine.close()
    finally:
        sender.close()
        for process in servers:
            process.stop()


@pytest.mark.timeout(180)
def test_restart_without_weights_waits_out_of_rotation_until_resynced(tmp_path):
    """The orchestrator's path (``WeightSync.heal``): restart, re-sync, rejoin (the weights
    saved here stand in for the trainer's push)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    dead = start_server(tmp_path / "a")
    try:
        alive = start_server(tmp_path / "b")
    except BaseException:
        dead.stop()
        raise
    try:
        engine = SGLangEngine(
            "/models/tiny",
            SGLangConfig(router=False, weight_transport="disk"),
            urls=[url_of(dead), url_of(alive)],
            weights_dir=str(tmp_path / "w"),
        )
    except BaseException:
        dead.stop()
        alive.stop()
        raise
    engine.servers[0].process, engine.servers[1].process = dead, alive
    tensors = [("lm_head.weight", torch.randn(4, 2))]
    try:
        engine.update_weights(iter(tensors), version=9)
        dead.process.kill()
        dead.process.wait(timeout=30)
        assert [engine.server_healthy(s) for s in engine.servers] == [False, True]
        engine.restart_server(engine.servers[0])
        assert engine.server_healthy(engine.servers[0]) and not engine.servers[0].serving
        for _ in range(4):  # generation only reaches the server that still has the weights
            out = engine.generate([[1]], 1, SamplingParams(max_new_tokens=1))
            assert out[0][0].weight_version == 9
        engine.sync_servers(iter(tensors), engine.weight_version(), [engine.servers[0]])
        engine.rejoin(engine.servers[0])
        assert engine.servers[0].serving
        assert weights_by_name(url_of(dead), "lm_head.weight") == tensors[0][1].flatten().tolist()
    finally:
        engine.close()  # stops both processes (the engine holds them)
