"""``rollout.sglang.weight_transport: distributed`` from the orchestrator's trainer worker (dist
tier): a one-rank megatron-core trainer (gloo) inside ``TrainerWorker`` streams its exported
policy into one stand-in SGLang server process and its reference into another (the dedicated
reference pool), each pool over its own weight-sync group (``test_rollout_sglang_http.py`` run as a
script) through ``TrainerWorker.push_weights``; and the disk transport's shards written by the
same rank. The stand-in hands back the tensors it received, compared bit for bit with the export
(the real server shows its weights only through its log-probs: the sglang tier, ``tests/sglang_tier``,
runs these transports against it).

Run as a script (``python this_file.py MODEL_DIR TARGETS_JSON OUT PORT``) it is the trainer rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def start_stand_in(tmp_path):
    """``test_rollout_sglang_http.py`` run as a server script on a free port."""
    from megatron_armor.rollout.sglang import launch

    port = sibling("test_rollout_export").free_port()
    cmd = [sys.executable, str(HERE / "test_rollout_sglang_http.py"), "--port", str(port)]
    process = launch.ManagedProcess(
        cmd, f"http://127.0.0.1:{port}/health_generate", str(tmp_path / "server.log")
    )
    process.start(env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    process.wait_healthy(timeout_s=90, poll_s=0.2)
    return process


def url_of(process) -> str:
    return process.health_url.removesuffix("/health_generate")


def weights_by_name(url: str, name: str) -> list[float]:
    """The stand-in's ``/get_weights_by_name``: the first 100 values of a received tensor."""
    import urllib.request

    body = json.dumps({"name": name, "truncate_size": 100}).encode()
    request = urllib.request.Request(
        f"{url}/get_weights_by_name", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def sibling(name: str):
    """Another test module of this folder, by path (tests are not a package)."""
    spec = importlib.util.spec_from_file_location(f"_armor_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer_main(model_dir: str, targets_json: str, out_path: str, port: int) -> None:
    """The trainer rank: policy pushes into server 0 (versions 3 and 4, one sender), the
    reference into server 1 (its own group), then version 5 after a dropped policy group; and
    a disk push of the policy (shards of at most 1 MB and their index)."""
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.config.validate import validate
    from megatron_armor.orchestration.actors.workers import TrainerWorker
    from megatron_armor.trainer.weight_sync import DiskRankSync, ServerTarget

    cfg = ArmorConfig()
    cfg.trainer.model_path, cfg.trainer.precision = model_dir, "fp32"
    cfg.rollout.backend, cfg.rollout.sglang.weight_transport = "sglang", "distributed"
    cfg.rollout.sglang.startup_timeout_s = 90.0
    cfg.data.max_prompt_len, cfg.rollout.sampling.max_new_tokens = 64, 64  # the tiny model's 128
    validate(cfg)  # the trainer takes a validated config (alpha resolved)
    policy, ref = [[ServerTarget(*t)] for t in json.loads(targets_json)]
    worker = TrainerWorker(cfg, 0, 1)
    worker.init("127.0.0.1", port)
    worker.sync.address = "127.0.0.1"
    try:
        sent = [worker.push_weights(3, "policy", "policy", policy)]
        sender = worker.sync.senders["policy"]
        sent.append(worker.push_weights(7, "ref", "ref", ref))
        sent.append(worker.push_weights(4, "policy", "policy", policy))
        same_sender = worker.sync.senders["policy"] is sender
        groups = {pool: s.group_name for pool, s in worker.sync.senders.items()}
        worker.drop_sender("policy")  # a policy server restarted: a new group next time
        sent.append(worker.push_weights(5, "policy", "policy", policy))
        disk_dir = os.path.join(os.path.dirname(out_path), "pushed")
        disk = DiskRankSync(worker.trainer, 1, model_dir)
        torch.save(
            {
                "weights": dict(worker.export_weights("policy")),
                "ref": dict(worker.export_weights("ref")),
                "bytes": sent,
                "disk_bytes": disk.push(6, "policy", "policy", disk_dir),
                "disk_dir": disk_dir,
                "groups": groups,
                "same_sender": same_sender,
                "renewed": worker.sync.senders["policy"] is not sender,
            },
            out_path,
        )
    finally:
        worker.close()


@pytest.mark.timeout(300)
def test_trainer_worker_streams_its_export_into_sglang_servers(tmp_path):
    from megatron_armor.config.schema import SGLangConfig
    from megatron_armor.rollout.protocol import SamplingParams
    from megatron_armor.rollout.sglang.engine import SGLangEngine
    from megatron_armor.trainer.hf_weights import SafetensorsDir

    export = sibling("test_rollout_export")
    model_dir = export.build_tiny_qwen2(tmp_path / "model")
    servers = []
    try:
        for i in range(2):
            (tmp_path / f"s{i}").mkdir()
            servers.append(start_stand_in(tmp_path / f"s{i}"))
        targets = [(url_of(p), 1) for p in servers]  # ServerTarget(url, tp)
        out = tmp_path / "out.pt"
        cmd = [
            sys.executable,
            __file__,
            model_dir,
            json.dumps(targets),
            str(out),
            str(export.free_port()),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        result = torch.load(out)
        weights = result["weights"]
        total = sum(t.numel() * t.element_size() for t in weights.values())
        assert result["bytes"] == [total] * 4 and result["same_sender"] and result["renewed"]
        assert result["groups"] == {"policy": "armor-weights-pp0", "ref": "armor-ref-weights-pp0"}
        assert len(weights) > 10 and result["ref"].keys() == weights.keys()
        assert result["disk_bytes"] == total  # the disk push: shards + index + config
        pushed = SafetensorsDir(result["disk_dir"])
        assert set(pushed.weight_map) == set(weights)  # the index names every tensor
        assert os.path.exists(os.path.join(result["disk_dir"], "config.json"))
        for name, tensor in weights.items():
            assert torch.equal(pushed.slice(name)[:], tensor), name
        for (url, _), expected, version in zip(
            targets, (weights, result["ref"]), (5, 7), strict=True
        ):
            for name, tensor in expected.items():
                got = torch.tensor(weights_by_name(url, name), dtype=tensor.dtype)
                assert torch.equal(got, tensor.flatten()[:100]), name
            engine = SGLangEngine("/models/tiny", SGLangConfig(router=False, max_retries=1),
                                  urls=[url])  # fmt: skip
            try:
                out_version = engine.generate([[1]], 1, SamplingParams(max_new_tokens=1))
                assert out_version[0][0].weight_version == version
            finally:
                engine.close()
    finally:
        for process in servers:
            process.stop()


if __name__ == "__main__":
    trainer_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
