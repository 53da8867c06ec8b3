"""Ray start-up and actor placement for the three layouts (docs/architecture.md).

- ``cpu``: no GPUs; every actor asks for a small, explicit CPU share. The tiny config.
- ``colocated``: one placement group of ``trainer.world_size`` GPU bundles; trainer rank
  ``i`` and rollout engine ``i // tp`` share bundle ``i`` (fractional GPUs); the engines
  release their memory while the trainer runs.
- ``disaggregated``: ``trainer.world_size`` bundles for the trainer plus
  ``orchestration.rollout_gpus`` bundles for the engines.

With ``rollout.backend: sglang`` the SGLang servers (``config.sglang_pools``: the policy
servers and, for a dedicated reference, the reference servers) are launched as subprocesses by
one rollout worker per node that holds any of them (a CPU actor placed in the bundle of that
node's first server, :func:`server_owner_options`, so that Ray leaves ``CUDA_VISIBLE_DEVICES``
alone for it though it has no GPUs).
Each server gets the physical GPU id of its first bundle (:func:`rollout_hosts`); the GPU
bundles are the trainer's (and, disaggregated, a reservation of the rollout GPUs after them).

Bundles are re-ordered by (node IP, GPU id) with one probe actor per bundle, so trainer rank
order follows the hardware (ranks of a TP group share a node). With ``trainer.world_size: auto``
(``config/world_size.py``) the group holds every GPU of the job, so the ranks fill every node;
``PACK`` only matters for a deliberately smaller group (``trainer.allow_idle_gpus``), which it
keeps on as few nodes as it can.

Threads: every trainer rank, rollout worker and reward worker runs
:func:`threads_per_actor` torch threads — the node's cores divided by the actors placed on
it (at least one), or ``orchestration.threads_per_actor`` — so the actors of a node never
run more threads than it has cores (OpenMP threads spin-wait; oversubscribed, they slow
every phase down, docs/orchestration.md "Threads").
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_armor.config.schema import ArmorConfig
from megatron_armor.config.validate import host_cores
from megatron_armor.orchestration.actors.ray_node import LocalRayHead
from megatron_armor.rollout.backends import backend_of
from megatron_armor.supervisor_pipe import tell_supervisor

LAYOUTS = ("cpu", "colocated", "disaggregated")
OBJECT_STORE_BYTES_CPU = 256 * 1024**2


@dataclass
class LayoutPlan:
    """How many actors of each kind, and what each asks Ray for."""

    layout: str
    trainer_ranks: int
    rollout_engines: int
    reward_workers: int
    trainer_gpus: float = 0.0
    rollout_gpus: float = 0.0
    cpus_per_actor: float = 1.0
    threads: int = 0
    bundles: int = 0
    trainer_bundles: list[int] = field(default_factory=list)
    rollout_bundles: list[int] = field(default_factory=list)
    server_bundles: dict[str, list[int]] = field(default_factory=dict)
    """SGLang: the bundle (sorted index) of each server's first GPU, per pool."""
    server_tp: dict[str, int] = field(default_factory=dict)
    """SGLang: GPUs per server, per pool."""
    nodes: int = 1
    """``orchestration.nodes``."""


def node_cores() -> int:
    """The cores this process may run on (its CPU affinity; all cores where unknown)."""
    return host_cores()


def actors_per_node(plan: LayoutPlan, gpus_per_node: int) -> int:
    """CPU-using actors on the busiest node: all of them for ``cpu``; else the most trainer
    ranks and rollout workers whose bundles share a node (bundle ``b`` on node
    ``b // gpus_per_node``; an SGLang rollout worker counts on every node) plus every reward
    worker (placed without a bundle, possibly all on one node)."""
    rewards = max(plan.reward_workers, 1)
    if plan.layout == "cpu":
        return plan.trainer_ranks + plan.rollout_engines + rewards
    per_node: dict[int, int] = {}
    for b in plan.trainer_bundles + plan.rollout_bundles:
        per_node[b // gpus_per_node] = per_node.get(b // gpus_per_node, 0) + 1
    sglang_worker = 0 if plan.rollout_bundles else 1
    return max(per_node.values(), default=0) + sglang_worker + rewards


def threads_per_actor(cores: int, actors: int, override: int = 0) -> int:
    """Torch threads per actor: ``override`` if set, else ``max(1, cores // actors)``."""
    if override > 0:
        return override
    return max(1, cores // max(actors, 1))


def plan_layout(config: ArmorConfig) -> LayoutPlan:
    """The actor counts and resources of ``orchestration.layout``; errors name the fix."""
    plan = _plan_bundles(config)
    plan.nodes = config.orchestration.nodes
    if backend_of(config).serves_over_http and plan.layout != "cpu":
        from megatron_armor.config.sglang_pools import pool_specs

        first = plan.trainer_ranks if plan.layout == "disaggregated" else 0
        specs = pool_specs(config)
        plan.server_bundles = {
            name: [first + g for g in spec.gpu_offsets()] for name, spec in specs.items()
        }
        plan.server_tp = {name: spec.tp for name, spec in specs.items()}
        # one worker per node with servers, known once the bundles are placed (rollout_hosts)
        plan.rollout_engines, plan.rollout_gpus, plan.rollout_bundles = 1, 0.0, []
    orch = config.orchestration
    plan.threads = threads_per_actor(
        node_cores(), actors_per_node(plan, orch.gpus_per_node), orch.threads_per_actor
    )
    return plan


@dataclass
class RolloutHost:
    """One SGLang rollout worker: the bundle it sits in (sorted index) and, per pool, the
    ``(server index, first GPU id)`` of the servers it launches on its node."""

    bundle: int
    ip: str
    servers: dict[str, list[tuple[int, int]]]


def rollout_hosts(plan: LayoutPlan, where: list[tuple[str, int]]) -> list[RolloutHost]:
    """One :class:`RolloutHost` per node with SGLang servers, in placement order. ``where`` is
    :func:`create_bundles`' (node IP, GPU id) of every bundle in sorted order; a server whose
    GPUs are not consecutive GPUs of one node is an error."""
    if not where or not plan.server_bundles:
        return []
    hosts: dict[str, RolloutHost] = {}
    for pool, bundles in plan.server_bundles.items():
        tp = plan.server_tp[pool]
        for index, first in enumerate(bundles):
            span = where[first : first + tp]
            ip, gpu = span[0]
            if len(span) < tp or span != [(ip, gpu + k) for k in range(tp)]:
                raise RuntimeError(
                    f"SGLang {pool} server {index} needs {tp} consecutive GPUs of one node but "
                    f"its bundles are {span}; make rollout.sglang.tp (or ref_pool.tp) divide "
                    "orchestration.gpus_per_node and give the job whole nodes"
                )
            host = hosts.setdefault(ip, RolloutHost(first, ip, {}))
            host.servers.setdefault(pool, []).append((index, gpu))
    return list(hosts.values())


def _plan_bundles(config: ArmorConfig) -> LayoutPlan:
    orch, world = config.orchestration, config.resolved.world_size
    engines = max(config.rollout.sglang.num_engines, 1)
    if orch.layout not in LAYOUTS:
        raise ValueError(f"orchestration.layout={orch.layout!r}: expected one of {LAYOUTS}")
    if orch.layout == "cpu":
        return LayoutPlan("cpu", world, 1, orch.num_reward_workers, cpus_per_actor=0.5)
    tp = config.rollout.sglang.tp
    if orch.layout == "colocated":
        if world % tp:
            raise ValueError(
                f"rollout.sglang.tp={tp} must divide trainer.world_size={world} (colocated)"
            )
        return LayoutPlan(
            "colocated", world, world // tp, orch.num_reward_workers, trainer_gpus=0.4,
            rollout_gpus=0.2, bundles=world, trainer_bundles=list(range(world)),
            rollout_bundles=list(range(0, world, tp)),
        )  # fmt: skip
    servers = backend_of(config).serves_over_http  # server pools are checked by pool_problems
    if not servers and (orch.rollout_gpus < tp or orch.rollout_gpus % tp):
        raise ValueError(
            f"orchestration.rollout_gpus={orch.rollout_gpus}: the disaggregated layout needs a "
            f"positive multiple of rollout.sglang.tp={tp}"
        )
    engines = orch.rollout_gpus // tp
    return LayoutPlan(
        "disaggregated", world, engines, orch.num_reward_workers, trainer_gpus=1.0,
        rollout_gpus=1.0, bundles=world + orch.rollout_gpus, trainer_bundles=list(range(world)),
        rollout_bundles=[world + i * tp for i in range(engines)],
    )  # fmt: skip


LOOPBACK = "127.0.0.1"


def use_token_auth(starting_local: bool) -> None:
    """Ray token authentication unless ``RAY_AUTH_MODE`` is set explicitly (``disabled`` is
    honoured, never chosen here). A local cluster gets a fresh random token for this run in the
    environment its processes inherit; joining a cluster uses the token it was started with
    (``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``, see slurm/armor.sbatch)."""
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    has_token = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if mode == "token" and starting_local and not has_token:
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def ray_environment(config: ArmorConfig) -> None:
    """The environment Ray's processes inherit; call it before ``import ray`` where possible
    (``armor train`` does), since Ray reads some of it at import. A local Ray gets token auth
    (:func:`use_token_auth`) and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which keeps Ray from
    replacing the loopback node IP by the node's network address."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    local = not config.orchestration.ray_address
    use_token_auth(starting_local=local)
    if local:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


_local_head: LocalRayHead | None = None


def init_ray(config: ArmorConfig, plan: LayoutPlan, log_dir: Path) -> None:
    """Connect to ``orchestration.ray_address``, or start a small Ray head for this run (no
    dashboard) in its own session, shielded from the stop signals (``ray_node.py``), and
    connect to it; its log is ``log_dir/ray-head.log``.

    A local Ray is a single-node cluster whose node IP is the loopback address, so GCS,
    raylet, object manager and workers listen on 127.0.0.1 only (Ray binds its servers to
    loopback when the node IP is loopback). Multi-node runs join a cluster the launch scripts
    started on the node IPs. Token authentication is on in both cases (:func:`use_token_auth`).
    """
    global _local_head
    ray_environment(config)
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    if config.orchestration.ray_address:
        ray.init(address=config.orchestration.ray_address, log_to_driver=True)
        report_ray_logs()
        return
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False  # read at import, maybe before the line above
    args = ["--include-dashboard=false"]
    if plan.layout == "cpu":
        actors = plan.trainer_ranks + plan.rollout_engines + plan.reward_workers
        args += [f"--num-cpus={max(int(actors * plan.cpus_per_actor) + 1, 2)}", "--num-gpus=0",
                 f"--object-store-memory={OBJECT_STORE_BYTES_CPU}"]  # fmt: skip
    timeout_s = config.orchestration.ray_init_timeout_s
    _local_head = LocalRayHead(args, log_dir / "ray-head.log", timeout_s, node_ip=LOOPBACK)
    ray.init(address=_local_head.address, log_to_driver=True, _node_ip_address=LOOPBACK)
    report_ray_logs()


def report_ray_logs() -> None:
    """Tell a supervising ``armor`` parent where Ray logs this driver: if Ray's core ends the
    process (raylet or GCS lost), the parent reads why there (``cli/supervise.py``)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)  # Ray's own record of this driver's node
    logs = getattr(node, "get_logs_dir_path", None)
    if logs is not None:
        tell_supervisor("ray_logs", logs())


def shutdown_ray(timeout_s: float = 30.0) -> None:
    """Disconnect from Ray and stop the head :func:`init_ray` started, if any, within about
    ``timeout_s``: half for the disconnect (one from a lost or stuck Ray is left to its daemon
    thread), the rest for the head, whose processes are killed after it."""
    global _local_head
    import ray

    end = time.monotonic() + timeout_s
    disconnect = threading.Thread(target=ray.shutdown, daemon=True, name="ray-shutdown")
    disconnect.start()
    disconnect.join(timeout_s / 2)
    if disconnect.is_alive():
        print(f"warning: ray.shutdown() did not return within {timeout_s:g}s; going on",
              flush=True)  # fmt: skip
    if _local_head is not None:
        _local_head.stop(max(end - time.monotonic(), 1.0))
        _local_head = None


def create_bundles(plan: LayoutPlan, timeout_s: float):
    """A placement group of one ``{GPU: 1, CPU: 1}`` bundle per GPU, the bundle indices sorted
    by (node IP, GPU id), and the (node IP, GPU id) of each in that order; ``(None, [], [])``
    for the CPU layout."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if plan.bundles == 0:
        return None, [], []
    pg = placement_group([{"GPU": 1, "CPU": 1}] * plan.bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise TimeoutError(
            f"placement group of {plan.bundles} GPUs not ready after {timeout_s:.0f}s; check the "
            "cluster's free GPUs or raise orchestration.ray_init_timeout_s"
        )

    @ray.remote(num_gpus=1, num_cpus=0)
    def probe():
        return ray.util.get_node_ip_address(), int(ray.get_gpu_ids()[0])

    refs = [
        probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote()
        for i in range(plan.bundles)
    ]  # fmt: skip
    where = ray.get(refs, timeout=timeout_s)
    order = sorted(range(plan.bundles), key=lambda i: (where[i][0], where[i][1]))
    return pg, order, [where[i] for i in order]


NSYS_TRAINER_OPTIONS = {
    "t": "cuda,nvtx,osrt,cublas,cudnn",
    "sample": "none",
    "capture-range": "cudaProfilerApi",
    "capture-range-end": "repeat",  # every chosen step (each a cudaProfilerStart/Stop range)
}


def trainer_runtime_env(config: ArmorConfig, rank: int) -> dict:
    """``logging.profile=nsys`` on an existing Ray cluster (a Slurm job): trainer rank ``rank``
    runs under Nsight Systems through Ray's ``nsight`` runtime env, capturing each chosen step
    (``cudaProfilerStart``/``Stop``, ``capture-range-end=repeat``: one report per step; with
    ``stop`` only the first). The reports, ``trainer_rank<R>_<pid>*.nsys-rep``, land in
    ``logs/nsight/`` of that node's Ray session directory (slurm/armor.sbatch gathers them).
    Without ``ray_address`` the whole driver runs under nsys (launch/profile.sh): ``{}``."""
    if config.logging.profile != "nsys" or not config.orchestration.ray_address:
        return {}
    return {"runtime_env": {"nsight": {**NSYS_TRAINER_OPTIONS, "o": f"trainer_rank{rank}_%p"}}}


SERVER_OWNER_ENV = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
"""Environment of a rollout worker that starts SGLang servers. The worker is a CPU actor
(``num_gpus=0``) placed in the bundle of its node's first server; its servers are subprocesses
that inherit its environment. Ray releases before the flip of this default (ray-project/ray
#62492) set ``CUDA_VISIBLE_DEVICES=""`` for an actor without GPUs, and the servers would then
see none; with the variable at 0 every Ray release leaves the node's devices visible."""


def server_owner_options(options: dict) -> dict:
    """``options`` of a rollout worker that launches SGLang servers (:data:`SERVER_OWNER_ENV`
    added to its runtime environment)."""
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **SERVER_OWNER_ENV}
    return {**options, "runtime_env": runtime_env}


def actor_options(plan: LayoutPlan, pg, order: list[int], bundle: int | None, gpus: float) -> dict:
    """Ray ``.options()`` for one actor: its CPU/GPU share and (if any) its bundle. CPU-layout
    actors of a multi-node job are spread over the nodes (Ray's ``SPREAD``)."""
    if pg is None or bundle is None:
        spread = {"scheduling_strategy": "SPREAD"} if plan.nodes > 1 else {}
        return {"num_cpus": plan.cpus_per_actor, "num_gpus": 0, **spread}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": 0.2,
        "num_gpus": gpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=order[bundle]
        ),
    }
