"""What a server process inherits from the rollout worker that starts it (sglang tier).

A Ray node that declares 2 GPUs (``CUDA_VISIBLE_DEVICES=0,1``; this machine has none), run the
way older Ray releases behave by default (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``: an actor
without GPUs gets ``CUDA_VISIBLE_DEVICES=""``), with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` exported
for the trainer as ``slurm/env/h100-ib.sh`` does. The rollout worker is a CPU actor with the
options the placement gives it (``placement.server_owner_options``): the real server it starts
on GPU 1 sees the node's GPUs, gets ``--base-gpu-id 1`` and does not inherit the trainer's
``CUDA_DEVICE_MAX_CONNECTIONS``. Without those options the worker sees no GPU and refuses to
start servers, naming the variable.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from process_group import server_pids
from sglang_servers import STARTUP_S, free_ports

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.orchestration.actors.call_watch import CallWatch, start_actor
from megatron_armor.orchestration.actors.placement import (
    LayoutPlan,
    actor_options,
    server_owner_options,
)
from megatron_armor.orchestration.actors.rollout_worker import RolloutWorker
from megatron_armor.rollout.sglang.launch import CPU_SERVER_ARGS

pytestmark = pytest.mark.sglang
CORES = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
NODE_ENV = {
    "CUDA_VISIBLE_DEVICES": "0,1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "SGLANG_USE_CPU_ENGINE": "1",  # the server below runs on CPU (its GPUs are declared only)
    # its CPU engine binds the threads of "GPU" 1 to the cores of entry 1 (one NUMA node here)
    "SGLANG_CPU_OMP_THREADS_BIND": "|".join([CORES, CORES]),
    "RAY_AUTH_MODE": "disabled",
}


def gpu_layout_config(model_dir, port: int) -> ArmorConfig:
    config = ArmorConfig()
    config.trainer.model_path, config.trainer.world_size = str(model_dir), 1
    config.rollout.backend = "sglang"
    config.orchestration.layout, config.orchestration.rollout_gpus = "disaggregated", 1
    config.orchestration.gpus_per_node = 2
    sg = config.rollout.sglang
    sg.num_engines, sg.base_port, sg.router, sg.startup_timeout_s = 1, port, False, STARTUP_S
    # what a GPU node would not need (the GPU id stays the placement's)
    sg.extra_args = {k: v for k, v in CPU_SERVER_ARGS.items() if k != "base_gpu_id"}
    return config


def process_env(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def process_args(pid: int) -> list[str]:
    return open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")


@pytest.fixture
def gpu_node(monkeypatch):
    import ray

    for key, value in NODE_ENV.items():
        monkeypatch.setenv(key, value)
    ray_tmp = tempfile.mkdtemp(prefix="ar", dir="/tmp")  # short: unix socket paths
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=ray_tmp,
             configure_logging=False)  # fmt: skip
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.timeout(900)
def test_a_rollout_worker_without_gpus_starts_servers_that_see_the_nodes_gpus(
    gpu_node, tiny_dir, tmp_path
):
    ray = gpu_node
    port = free_ports(1)[0]
    config = gpu_layout_config(tiny_dir / "model", port)
    config.run.output_dir, config.run.name = str(tmp_path), "env"
    plan = LayoutPlan("disaggregated", trainer_ranks=1, rollout_engines=1, reward_workers=1)
    base = actor_options(plan, None, [], None, 0.0)
    assert base["num_gpus"] == 0
    servers = {"policy": [(0, 1)]}  # server 0 on GPU 1 of this node
    watch = CallWatch()
    blind = start_actor(watch, RolloutWorker, base, config, 0, 1, servers)
    with pytest.raises(ray.exceptions.RayActorError, match="RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"):
        ray.get(blind.health.remote(), timeout=300)
    worker = start_actor(watch, RolloutWorker, server_owner_options(base), config, 0, 1, servers)
    try:
        assert ray.get(worker.health.remote(), timeout=2 * STARTUP_S)
        (leader,) = server_pids(port)
        env, args = process_env(leader), process_args(leader)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
        assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
        assert args[args.index("--base-gpu-id") + 1] == "1"
    finally:
        ray.get(worker.close.remote(), timeout=120)
