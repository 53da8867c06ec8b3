"""Unit tier: what a server is started with (``rollout/sglang/launch.py``) and the orders the
project keeps with SGLang (pipeline stages streaming in turns; the rollout workers' options)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from megatron_armor.orchestration.actors.placement import SERVER_OWNER_ENV, server_owner_options
from megatron_armor.rollout.sglang import launch
from megatron_armor.trainer import weight_sync

pytestmark = pytest.mark.unit


def test_cpu_additions_come_from_one_place_and_extra_args_override_them() -> None:
    args = launch.server_args_for("m", 30000, on_cpu=True, base_gpu_id=3,
                                  extra_args={"max_total_tokens": 8192})  # fmt: skip
    for key, value in launch.CPU_SERVER_ARGS.items():
        assert args[key] == (8192 if key == "max_total_tokens" else value), key
    gpu = launch.server_args_for("m", 30000, base_gpu_id=3)
    assert gpu["base_gpu_id"] == 3 and not set(launch.CPU_SERVER_ARGS) - {"base_gpu_id"} & set(gpu)


def test_only_a_colocated_reference_pool_keeps_a_host_copy_of_its_weights() -> None:
    ref = launch.server_args_for("m", 1, colocated=True, weights_cpu_backup=True)
    assert ref["enable_memory_saver"] and ref["enable_weights_cpu_backup"]
    policy = launch.server_args_for("m", 1, colocated=True)
    assert "enable_weights_cpu_backup" not in policy
    assert "enable_weights_cpu_backup" not in launch.server_args_for(
        "m", 1, weights_cpu_backup=True
    )


def test_a_server_does_not_inherit_the_trainers_cuda_connections(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    log = tmp_path / "server.log"
    probe = (
        "import os; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), "
        "os.environ.get('SGLANG_USE_CPU_ENGINE'), os.environ['SGLANG_RETURN_ORIGINAL_LOGPROB'])"
    )
    process = launch.ManagedProcess([sys.executable, "-c", probe], "http://unused", str(log))
    process.start(env=launch.server_env(on_cpu=True))
    process.process.wait(timeout=60)
    assert log.read_text().split() == ["None", "1", "false"]
    assert launch.server_env(on_cpu=False).get("SGLANG_USE_CPU_ENGINE") is None


def test_rollout_workers_keep_the_nodes_gpus_visible() -> None:
    base = {"num_cpus": 1, "num_gpus": 0, "runtime_env": {"env_vars": {"A": "1"}}}
    opts = server_owner_options(base)
    assert opts["runtime_env"]["env_vars"] == {"A": "1", **SERVER_OWNER_ENV}
    assert opts["num_gpus"] == 0 and base["runtime_env"]["env_vars"] == {"A": "1"}


@pytest.mark.parametrize("pp_rank", [0, 1, 2])
def test_pipeline_stages_stream_in_turns(monkeypatch, pp_rank) -> None:
    """Stage ``s`` streams between barrier ``s - 1`` and barrier ``s``: no two stages send
    at once, so two servers cannot take two stages' broadcasts in opposite orders."""
    from megatron_armor.trainer import parallel

    events: list[str] = []
    monkeypatch.setattr(parallel, "pp_size", lambda: 3)
    monkeypatch.setattr(parallel, "pp_rank", lambda: pp_rank)
    monkeypatch.setattr(weight_sync.dist, "barrier", lambda: events.append("barrier"))
    sync = weight_sync.DistributedRankSync(trainer=None, bucket_mb=1)

    def push_stage(version, weights, pool, target):
        events.append(f"send {pp_rank}")
        return 7

    monkeypatch.setattr(sync, "_push_stage", push_stage)
    assert sync.push(1, "policy", "policy", []) == 7
    expected = ["barrier"] * 3
    expected.insert(pp_rank, f"send {pp_rank}")
    assert events == expected
    assert weight_sync.stage_turns(3) == [0, 1, 2]


class ExportingTrainer:
    """Stands in for a trainer rank's ``export_weights`` (one rank, no TP/PP): fresh tensors
    per export, watched by weak references; it cannot show the CUDA allocator itself (the
    gpu test ``test_released_weights_come_back_by_a_push_at_the_same_version`` measures the
    cached bytes after a push on a GPU)."""

    def __init__(self) -> None:
        self.alive: list = []

    def export_weights(self, weights, device=None, every_rank=False):
        import weakref

        import torch

        for i in range(4):
            tensor = torch.full((1024,), float(i))
            self.alive.append(weakref.ref(tensor))
            yield f"w{i}", tensor


@pytest.mark.parametrize("colocated", [True, False])
def test_a_colocated_push_hands_its_buffers_back_before_it_returns(monkeypatch, colocated):
    """``tensor`` (colocated): after the last bucket reached the server, with every gathered
    tensor and bucket dropped, the push returns the cached blocks to CUDA, all before it
    returns, so the KV cache resumed after the push (``phases.sync_and_maybe_reset``) finds
    the memory free; a ``disk`` push returns them only when colocated."""
    from megatron_armor.trainer import parallel

    events: list[str] = []
    trainer = ExportingTrainer()

    def returned() -> None:
        events.append(f"returned, {sum(r() is not None for r in trainer.alive)} tensors alive")

    monkeypatch.setattr(weight_sync, "return_cached_blocks", returned)
    monkeypatch.setattr(parallel, "pp_size", lambda: 1)
    monkeypatch.setattr(weight_sync.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(weight_sync.dist, "barrier", lambda: events.append("barrier"))
    sync = weight_sync.TensorRankSync(trainer, bucket_mb=1)
    monkeypatch.setattr(sync, "_gather_group", lambda server: "group")
    monkeypatch.setattr(sync, "_post", lambda *args: events.append("post"))
    target = [weight_sync.ServerTarget("http://server", 1, 0)]
    assert sync.push(3, "policy", "policy", target) == 4 * 1024 * 4
    assert events == ["post", "barrier", "returned, 0 tensors alive"]

    events.clear()
    monkeypatch.setattr(weight_sync.DiskRankSync, "_push", lambda *args: events.append("wrote"))
    weight_sync.DiskRankSync(trainer, 1, "model", colocated=colocated).push(
        3, "policy", "policy", "d"
    )
    assert events == ["wrote", "returned, 0 tensors alive"] if colocated else ["wrote"]


def test_managed_process_env_none_removes_a_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ARMOR_TEST_GONE", "x")
    log = tmp_path / "p.log"
    process = launch.ManagedProcess(
        [sys.executable, "-c", "import os; print(os.environ.get('ARMOR_TEST_GONE'))"],
        "http://unused", str(log),
    )  # fmt: skip
    process.start(env={"ARMOR_TEST_GONE": None})
    deadline = time.monotonic() + 60
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_text().strip() == "None"


def test_a_stopped_server_is_killed_at_once_on_stop() -> None:
    """A SIGSTOPped process never acts on SIGTERM: ``stop`` SIGKILLs its group at once
    instead of waiting its grace period out."""
    import signal

    process = launch.ManagedProcess(
        [sys.executable, "-c", "import time; time.sleep(600)"], "http://unused"
    )
    process.start()
    pid = process.process.pid
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not launch.is_stopped(pid):
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.02)
    started = time.monotonic()
    process.stop(timeout_s=30)
    assert time.monotonic() - started < 5
    assert process.process.returncode == -signal.SIGKILL
    assert not launch.is_stopped(pid)  # gone
